"""``integrations/relay.py`` in the engine's process: which ranks share the node, and the memory
rule as vLLM receives it.

Ranks of vLLM's Ray executor (Serve LLM's) are Ray workers placed by the placement group the
engine's process runs in: the relay counts them as this node's only when every bundle is here
(a real placement group on a real local Ray). vLLM's Ray executor itself refuses the CPU
platform here (``current platform cpu does not support ray``), so no engine runs that way.

The memory rule: ``integrations/relay.py``'s wrapper of vLLM 0.32's real
``EngineArgs.create_engine_config`` against moto, at ``tensor_parallel_size=2`` (two readers
on the node).

The relay's local copy is read with a small buffer, and the limit travels in the engine's
load config (``model_loader_extra_config["memory_limit"]``), which vLLM's runai loader turns
into ``RUNAI_STREAMER_MEMORY_LIMIT`` in whichever process loads: a rank of vLLM's Ray
executor is a Ray worker that never sees the engine process's environment, so the probe
loads the config in an environment without it, as that rank does. The control (the shim
off) hands vLLM no limit. The checkpoint here is tiny, so the probe lowers the rule's buffer
(``LOCAL_READ_BYTES``) below it; the rule's values are ``tests/snapshot/test_memory.py``'s.
"""

from __future__ import annotations

import os
import tempfile
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
from ray_runai_shim.integrations import relay
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
relay.release_all()
print(json.dumps(out))
"""


def probe(sandbox, model, relay_dir: Path, **env: str) -> dict:
    sandbox.env.pop("RUNAI_STREAMER_MEMORY_LIMIT", None)
    sandbox.env.update(RAY_RUNAI_SHIM_RELAY_DIR=str(relay_dir), **env)
    return last_json(run_python(PROBE.format(uri=model.uri, buffer=BUFFER), env=sandbox.env))


@pytest.fixture
def relay_dir():
    d = Path(tempfile.mkdtemp(prefix="rrs-relay-budget-", dir="/dev/shm"))
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_the_ranks_get_the_relay_copys_buffer_through_the_load_config(s3, models, sandbox, relay_dir):
    model = models[MODEL]
    sizes = [(model.local / w).stat().st_size for w in model.weights]
    assert sum(sizes) > 2 * BUFFER  # the rule binds on this checkpoint
    out = probe(sandbox, model, relay_dir)
    assert out["weights"].startswith(str(relay_dir)), out  # two readers: relayed
    limit = out["extra"]["memory_limit"]
    assert BUFFER <= limit < sum(sizes), out  # the buffer (or the largest tensor), less than the checkpoint
    assert out["engine_env"] == str(limit) and out["rank_env"] == str(limit), out
    assert os.listdir(relay_dir) == []  # the probe's release freed the copy


@pytest.mark.slow
def test_control_without_the_shim_vllm_gets_no_limit(s3, models, sandbox, relay_dir):
    out = probe(sandbox, models[MODEL], relay_dir, RAY_RUNAI_SHIM_DISABLE="1")
    assert out["patched"] == [] and out["weights"] == models[MODEL].uri and not out["extra"], out
    assert out["engine_env"] is None and out["rank_env"] is None, out


PLACEMENT = """
import json, ray
from types import SimpleNamespace
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray_runai_shim.integrations.relay import ranks_all_here
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
