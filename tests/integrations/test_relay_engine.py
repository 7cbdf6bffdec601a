"""``integrations/engine_relay.py`` in the engine's process: which ranks share the node, and the memory
limit as vLLM's ranks receive it.

Ranks of vLLM's Ray executor (Serve LLM's) are Ray workers placed by the engine's placement
group: they count as this node's only when every bundle is here (a real placement group on a
real local Ray; the executor itself refuses this CPU platform, so no engine runs that way).
Such a rank never sees the engine's environment: the limit travels in the load config
(``model_loader_extra_config["memory_limit"]``), which vLLM's runai loader applies in the
process that loads. Checked with vLLM 0.32's real ``create_engine_config`` (wrapped by the
shim) against moto at ``tensor_parallel_size=2``, and its real loader in an environment without
the limit; the probe lowers ``LOCAL_READ_BYTES`` below the tiny checkpoint so the rule binds
(the rule's values: ``tests/snapshot/test_memory.py``). Control: the shim off, no limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.procs import last_json, run_python

MODEL = "tiny-sharded"
BUFFER = 64 << 10  # the tiny checkpoint is ~0.8 MB

PROBE = """
import json, os, pickle
import ray  # the shim installs its patches once Ray is imported, as in a stage actor or a replica
import ray_runai_shim
from ray_runai_shim.snapshot import memory
memory.LOCAL_READ_BYTES = {buffer}
import vllm.engine.arg_utils as au
from ray_runai_shim.integrations import engine_relay
args = au.EngineArgs(model={uri!r}, load_format="runai_streamer", tensor_parallel_size=2, dtype="float32",
                     max_model_len=128, enforce_eager=True)
config = args.create_engine_config()
out = {{"weights": config.model_config.model_weights, "extra": config.load_config.model_loader_extra_config,
        "engine_env": os.environ.pop("RUNAI_STREAMER_MEMORY_LIMIT", None)}}
# A rank elsewhere: the config as pickled to it, an environment without the engine's limit.
from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader
RunaiModelStreamerLoader(pickle.loads(pickle.dumps(config.load_config)))
out["rank_env"] = os.environ.get("RUNAI_STREAMER_MEMORY_LIMIT")
out["patched"] = ray_runai_shim.status()["patched"]
engine_relay.release_all()
print(json.dumps(out))
"""


def probe(sandbox, model, relay_dir: Path, **env: str) -> dict:
    sandbox.env.pop("RUNAI_STREAMER_MEMORY_LIMIT", None)
    sandbox.env.update(RAY_RUNAI_SHIM_RELAY_DIR=str(relay_dir), **env)
    return last_json(run_python(PROBE.format(uri=model.uri, buffer=BUFFER), env=sandbox.env))


@pytest.mark.slow
def test_the_ranks_get_the_relay_copys_buffer_through_the_load_config(s3, models, sandbox, shm_relay_dir):
    model = models[MODEL]
    sizes = [(model.local / w).stat().st_size for w in model.weights]
    assert sum(sizes) > 2 * BUFFER  # the rule binds on this checkpoint
    out = probe(sandbox, model, shm_relay_dir)
    assert out["weights"].startswith(str(shm_relay_dir)), out  # two readers: relayed
    limit = out["extra"]["memory_limit"]
    assert BUFFER <= limit < sum(sizes), out  # the buffer (or the largest tensor), less than the checkpoint
    assert out["engine_env"] == str(limit) and out["rank_env"] == str(limit), out
    left = sorted(str(p.relative_to(shm_relay_dir)) for p in shm_relay_dir.rglob("*"))
    assert left == [], left  # the probe's release freed the copy


@pytest.mark.slow
def test_control_without_the_shim_vllm_gets_no_limit(s3, models, sandbox, shm_relay_dir):
    out = probe(sandbox, models[MODEL], shm_relay_dir, RAY_RUNAI_SHIM_DISABLE="1")
    assert out["patched"] == [] and out["weights"] == models[MODEL].uri and not out["extra"], out
    assert out["engine_env"] is None and out["rank_env"] is None, out


EXIT_MID_COPY = """
import atexit, json, sys, threading
from ray_runai_shim.snapshot import relay
from ray_runai_shim.integrations import engine_relay
if sys.argv[1] == "control":  # the exit wait where it was until 2026-12: atexit, run after
    # concurrent.futures has shut its pools at the main thread's end
    threading._threading_atexits[:] = [c for c in threading._threading_atexits
                                       if getattr(c, "func", None) is not engine_relay._at_exit]
    atexit.register(engine_relay._at_exit)
got = relay.acquire(sys.argv[2], pipelined=True)
engine_relay._held.append(got)
engine_relay.release_all()  # this engine is done (or gave up) at once; the copy goes on in its thread
print(json.dumps({"live": got.live}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("exit_hook", ["threading", "control"])
def test_a_process_that_exits_mid_copy_finishes_the_copy_and_frees_it(s3, models, sandbox, shm_relay_dir, exit_hook):
    """An engine's process that ends while the copy it makes is still coming (over a slow link)
    finishes it first (bounded: ``EXIT_WAIT_S``): the store sent every weight byte once and the
    node is left clean. Control: the wait run by ``atexit`` -- after ``concurrent.futures`` has
    refused new work -- the copy fails mid-way and leaves a ``.failed`` note that sends the
    node's next readers to the store."""
    from support.proxy import CountingProxy

    model = models[MODEL]
    size = sum((model.local / w).stat().st_size for w in model.weights)
    with CountingProxy(s3.port, rate=size / 3) as proxy:  # ~3 s for the copy
        sandbox.env.update(AWS_ENDPOINT_URL=proxy.endpoint, AWS_ENDPOINT_URL_S3=proxy.endpoint,
                           RAY_RUNAI_SHIM_RELAY_DIR=str(shm_relay_dir))
        out = last_json(run_python(EXIT_MID_COPY, env=sandbox.env, args=(exit_hook, model.uri)))
        sent = proxy.body_bytes(".safetensors")
    assert out["live"]  # the process let go while its copy was still being made
    left = sorted(p.name for p in shm_relay_dir.rglob("*"))
    if exit_hook == "control":
        assert any(name.endswith(".failed") for name in left), left
        assert sent < size, (sent, size)
    else:
        assert left == [] and sent == size, (left, sent, size)


PLACEMENT = """
import json, ray
from types import SimpleNamespace
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray_runai_shim.integrations.reader_count import ranks_all_here
ray.init(num_cpus=2, include_dashboard=False)
engine = SimpleNamespace(distributed_executor_backend="ray", tensor_parallel_size=2, pipeline_parallel_size=1)

@ray.remote(num_cpus=0)
def here(engine):
    return ranks_all_here(engine)

pg = placement_group([{"CPU": 1}] * 2)
ray.get(pg.ready())
out = {"bundles_here": ray.get(here.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote(engine)),
       "no_placement_group": ray.get(here.remote(engine)),
       "mp": ranks_all_here(SimpleNamespace(distributed_executor_backend="mp", tensor_parallel_size=2)),
       "external": ranks_all_here(SimpleNamespace(distributed_executor_backend="external_launcher",
                                                  tensor_parallel_size=2))}
ray.shutdown()
print(json.dumps(out))
"""


@pytest.mark.ray
def test_ray_executor_ranks_count_as_this_nodes_only_inside_a_placement_group_all_here(sandbox):
    out = last_json(run_python(PLACEMENT, env=sandbox.env, cwd=sandbox.root))
    assert out == {"bundles_here": True, "no_placement_group": False, "mp": True, "external": False}, out
