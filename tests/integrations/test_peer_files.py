"""#16 part 1: tensor parallel across two nodes that share no disk (vllm#50616).

Node 2 runs ``ray start`` in a mount namespace of its own, with an empty tmpfs over
the sandbox (HOME, HF_HOME and the shim's cache in it, XDG cache): it cannot see a file
node 1 wrote there. vLLM's CPU engine runs ``tensor_parallel_size=2`` with its Ray executor, one
worker per node (a test-only site hook lets vLLM's CPU platform use that executor:
``rrs_cpu_ray``). The model is a custom-code checkpoint (``auto_map``), so each worker
imports the model's ``.py`` file from ``model_config.model`` -- the directory that
exists only on the node that built the config.

Two routes reach vLLM's workers with that directory:

* ``handoff`` -- what the shim hands vLLM on Ray 2.45-2.51: its own snapshot dir as
  ``model`` and the URI as ``model_weights``;
* ``vllm-pull`` -- upstream's own path on newer Ray: the URI as ``model``; vLLM pulls
  the non-weight files into ``model_streamer/<hash>`` on the engine's node only.

Without the shim the worker on node 2 fails on either route; with it, node 2 gets the
non-weight files (and no weight byte), and both ranks stream and generate.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.cluster import RayCluster
from support.fixtures import BUCKET, CACHE
from support.procs import last_json, run_python
from support.tiny_model import (
    REMOTE_CODE_ARCH,
    REMOTE_CODE_FILE,
    build_tiny_model,
    copy_nonweight_files,
    remote_code_variant,
    upload_dir,
)

from ray_runai_shim import ShimError
from ray_runai_shim.integrations import peer_files

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

ENGINE = pytest.mark.engine

SANDBOX_DIRS = ("home", "hf", "cache")

DRIVER = """
if __name__ == "__main__":
    import json, os, sys
    import ray_runai_shim  # the user's script; RAY_RUNAI_SHIM_DISABLE=1 (the control) turns it off
    import ray
    ray.init(address={address!r})
    model, extra = {uri!r}, {{}}
    if {route!r} == "handoff":  # a local dir on this node as model, the URI as model_weights
        model, extra = {local!r}, {{"model_weights": {uri!r}}}
        if not model:  # what the shim's stage / Serve wrappers hand vLLM on Ray 2.45-2.51
            from ray_runai_shim.integrations.decide import streaming_request
            from ray_runai_shim.snapshot.nonweights import fetch_for
            model = fetch_for(streaming_request({uri!r}, {{"load_format": "runai_streamer"}}))
    from vllm import LLM, SamplingParams
    result = {{"model": model}}
    try:
        llm = LLM(model=model, load_format="runai_streamer", trust_remote_code=True, tensor_parallel_size=2,
                  distributed_executor_backend="ray", dtype="float32", max_model_len=128, enforce_eager=True,
                  max_num_seqs=4, **extra)
        out = llm.generate(["Hello world", "The quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
        result["texts"] = [o.outputs[0].text for o in out]
        result["told"] = llm.llm_engine.vllm_config.model_config.model
        result["arch"] = llm.llm_engine.vllm_config.model_config.architectures
    except Exception as e:
        result["error"] = f"{{type(e).__name__}}: {{e}}"

    @ray.remote(num_cpus=0, resources={{"n2": 0.01}})
    def node2_files(root):
        found = []
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                p = os.path.join(dirpath, f)
                found.append([os.path.relpath(p, root), os.path.getsize(p)])
        return {{"files": found, "shim": "ray_runai_shim" in sys.modules}}

    result["node2"] = ray.get(node2_files.remote({root!r}))
    print(json.dumps(result))
"""


def _unshare_works() -> str:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else probe.stderr.strip() or "unshare failed"


@pytest.fixture(scope="module")
def remote_code_model(s3, tmp_path_factory):
    """The tiny sharded model as a custom-code checkpoint, in the bucket."""
    local = remote_code_variant(build_tiny_model(CACHE / "tiny-sharded-v1", shards=2),
                                tmp_path_factory.mktemp("remote-code") / "tiny-remote-code")
    upload_dir(s3.client(), local, BUCKET, "llm/tiny-remote-code")
    return local, f"s3://{BUCKET}/llm/tiny-remote-code"


def run_across_nodes(sandbox, model: Path, uri: str, route: str, shim: bool, relay_dirs: tuple[Path, ...] = (),
                     **extra_env: str) -> tuple[dict, str, dict[str, str]]:
    """Head (node 1) + node 2 in its own mount namespace; the driver on node 1; *relay_dirs*: each
    node's own relay directory (as on separate machines), else the shared default.
    (the driver's verdict, its output, each Ray worker's log file)"""
    why = _unshare_works()
    if why:
        pytest.skip(f"no private mount namespace here: {why}")
    env = {**sandbox.env, "RAY_RUNAI_SHIM_TEST_CPU_RAY": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra_env}
    env.pop("RAY_RUNAI_SHIM_TEST_ENGINE_LOG", None)
    for shared in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):  # the nodes share no disk: not even
        env.pop(shared, None)  # the other tests' vLLM or torch caches
    if not shim:
        env["RAY_RUNAI_SHIM_DISABLE"] = "1"
    with RayCluster(env) as cluster:
        # TMPDIR stays shared: both "nodes" have one IP here, so vLLM takes them for one node and
        # connects its ranks through IPC sockets under TMPDIR (separate machines use TCP).
        env["TMPDIR"] = str(cluster.root / "tmp")
        (cluster.root / "tmp").mkdir()
        cluster.env.update(HOME=env["HOME"], TMPDIR=env["TMPDIR"])
        own = [{"RAY_RUNAI_SHIM_RELAY_DIR": str(d)} for d in relay_dirs] or [None, None]
        cluster.start_head('--resources={"n1": 1, "vcpu": 1}', "--num-cpus=1", "--num-gpus=0", env=own[0])
        cluster.add_node('--resources={"n2": 1, "vcpu": 1}', "--num-cpus=1", "--num-gpus=0", env=own[1],
                         private=[sandbox.root], make=[sandbox.root / d for d in SANDBOX_DIRS])
        # Without the shim, Ray 2.45-2.51 hands vLLM its own copy on the engine's node: the files, here.
        local = "" if shim else str(copy_nonweight_files(model, sandbox.root / "ray-copy"))
        code = DRIVER.format(address=cluster.address, uri=uri, route=route, root=str(sandbox.root), local=local)
        proc = run_python(code, env=env, timeout=900, cwd=sandbox.root)
        workers = {p.name: p.read_text(errors="replace") for p in cluster.root.glob("t/session_2*/logs/worker-*")}
    return last_json(proc), proc.stdout + proc.stderr, workers


def _weights_on(files: list[list]) -> list[str]:
    return [rel for rel, size in files if rel.endswith(".safetensors") or size > 1 << 20]


@ENGINE
# The vllm-pull route (and its control) is extended: the same fix and the same cluster relay for
# the ranks as the handoff route, which runs in CI with its control.
@pytest.mark.parametrize("route", ["handoff", pytest.param("vllm-pull", marks=pytest.mark.extended)])
def test_tensor_parallel_across_nodes_without_a_shared_disk(s3, sandbox, remote_code_model, route):
    """... and (#37) the ranks read the store once: each takes the weights through its own node's
    relay, and the two relays share them through Ray's object store."""
    out, driver, workers, sent, size = cluster_relay_across_nodes(s3, sandbox, remote_code_model, "auto", route)
    assert "error" not in out, out.get("error")
    assert out["arch"] == [REMOTE_CODE_ARCH]
    # Greedy text the tiny model was trained on: with TP=2 half of every layer is on node 2's rank,
    # whose weights can only have come from the bucket (no weight file on node 2, checked below).
    assert out["texts"] == [", this is a tiny llama model for", " jumps over the lazy dog."], out["texts"]
    # Node 2 got the non-weight files (the model's code among them) and not one weight file.
    node2 = {rel: size for rel, size in out["node2"]["files"]}
    fetched = {rel.split("/")[-1] for rel in node2 if "/ray-runai-shim/" in f"/{rel}"}
    assert REMOTE_CODE_FILE in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert _weights_on(out["node2"]["files"]) == []
    assert out["node2"]["shim"] is True  # the job's setup hook carried it to node 2
    [fetch_line] = {line for line in driver.splitlines() if "was not on this node" in line}  # node 2 only
    told = out["told"]
    if route == "handoff":
        # The same cache root on both nodes: node 2's snapshot is at the very path vLLM was told.
        told_rel = Path(told).relative_to(sandbox.root).as_posix()
        assert {"config.json", REMOTE_CODE_FILE} <= {rel[len(told_rel) + 1:] for rel in node2
                                                     if rel.startswith(told_rel + "/")}
    else:
        assert "/model_streamer/" in told  # vLLM's own pull dir, on node 1 only
    assert f"{told} was not on this node" in fetch_line
    # #37: each rank took the weights through its own node's relay; the store sent S once, not twice.
    logs = driver + "\n".join(workers.values())
    ranks = set(re.findall(r"this rank of an engine spread over nodes reads .*? \(pid (\d+)\)", logs))
    assert len(ranks) == 2, logs[-4000:]
    assert "cluster relay: taking s3://" in logs
    assert sent <= 1.1 * size, (sent, size, [ln for ln in logs.splitlines() if "relay" in ln][-20:])


# CI time (#37): the control (each route) runs in test-all; CI runs the handoff route above.
@ENGINE
@pytest.mark.extended
@pytest.mark.parametrize("route", ["handoff", "vllm-pull"])
def test_control_without_the_shim_the_second_nodes_worker_fails(sandbox, remote_code_model, route):
    local, uri = remote_code_model
    out, driver, workers = run_across_nodes(sandbox, local, uri, route, shim=False)
    logs = driver + "\n".join(workers.values())
    assert "error" in out, out
    # The worker on node 2 (TP rank 0 or 1: Ray's placement decides) cannot import the model's code
    # from the dir it was told...
    assert "RayWorkerProc.initialize_worker" in out["error"]
    assert f"Model architectures ['{REMOTE_CODE_ARCH}'] are not supported" in out["error"]
    assert re.search(rf"Worker_TP[01] .*Unable to load {REMOTE_CODE_FILE[:-3]}\.{REMOTE_CODE_ARCH} from /", logs)
    # ... because node 2 has none of the model's files.
    assert not any("/ray-runai-shim/" in f"/{rel}" for rel, _ in out["node2"]["files"])
    assert out["node2"]["shim"] is False and "was not on this node" not in logs


def cluster_relay_across_nodes(s3, sandbox, remote_code_model, setting: str, route: str = "handoff"
                               ) -> tuple[dict, str, dict[str, str], int, int]:
    """TP = 2 with a rank on each node, each node with its own relay directory, the bucket behind
    the counting proxy. (verdict, driver output, worker logs, weight bytes the store sent, the
    checkpoint's weight bytes)"""
    from support.proxy import CountingProxy
    from support.shm import tmpdir

    local, uri = remote_code_model
    with CountingProxy(s3.port) as proxy, tmpdir("rrs-relay-n1-") as r1, tmpdir("rrs-relay-n2-") as r2:
        out, driver, workers = run_across_nodes(
            sandbox, local, uri, route, shim=True, relay_dirs=(r1, r2), AWS_ENDPOINT_URL=proxy.endpoint,
            AWS_ENDPOINT_URL_S3=proxy.endpoint, RAY_RUNAI_SHIM_CLUSTER_RELAY=setting)
        left = [str(p) for d in (r1, r2) for p in d.rglob("*")]
        sent = proxy.body_bytes(".safetensors")
    size = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    assert left == [], left  # both nodes' relay dirs clean once the engine loaded
    return out, driver, workers, sent, size


@ENGINE
@pytest.mark.extended
def test_control_the_ranks_on_two_nodes_without_the_cluster_relay_read_it_once_each(s3, sandbox, remote_code_model):
    """#37's control: sharing off, each rank streams the whole checkpoint from the store."""
    out, driver, workers, sent, size = cluster_relay_across_nodes(s3, sandbox, remote_code_model, "off")
    logs = driver + "\n".join(workers.values())
    assert out["texts"] == [", this is a tiny llama model for", " jumps over the lazy dog."], out["texts"]
    assert sent >= 2 * size and "this rank of an engine spread over nodes" not in logs


# --------------------------------------------------------------------------- the wrapper, in-process


def _worker(model: str, weights: str | None, load_format: str = "runai_streamer", **load: object):
    config = SimpleNamespace(model_config=SimpleNamespace(model=model, tokenizer=model, model_weights=weights),
                             load_config=SimpleNamespace(load_format=load_format, **load))
    return SimpleNamespace(rpc_rank=0, global_rank=1), ([{"vllm_config": config}],), config


def test_which_worker_configs_are_left_alone(tmp_path):
    here = tmp_path / "model"
    here.mkdir()
    cases = [
        (str(here), "s3://b/m"),  # the files are on this node
        ("s3://b/m", None),  # not a local path
        ("relative/dir", "s3://b/m"),
        (str(tmp_path / "gone"), None),  # no weights URI: vLLM's own behaviour
        (str(tmp_path / "gone"), "/local/weights"),
    ]
    for model, weights in cases:
        instance, args, config = _worker(model, weights)
        seen: list = []
        peer_files.init_worker(lambda *a, seen=seen, **k: seen.append(a), instance, args, {})
        assert seen == [args] and config.model_config.model == model


def test_the_weights_source_as_vllm_holds_it(monkeypatch):
    _, _, c = _worker("/x", "s3://b/m")
    assert peer_files.weights_source(c.model_config, c.load_config) == ("s3://b/m", "runai_streamer")
    _, _, c = _worker("/x", None, "tensorizer", model_loader_extra_config={"tensorizer_uri": "s3://b/m/model.tensors"})
    assert peer_files.weights_source(c.model_config, c.load_config) == ("s3://b/m", "tensorizer")
    monkeypatch.setenv("RUNAI_STREAMER_S3_UNSIGNED", "1")  # the streamer's spelling of Ray's anonymous@
    _, _, c = _worker("/x", "s3://b/m")
    assert peer_files.weights_source(c.model_config, c.load_config)[0] == "s3://anonymous@b/m"


def test_an_unreachable_source_is_a_clear_error_before_the_worker_starts(s3, monkeypatch, tmp_path):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    instance, args, _ = _worker(str(tmp_path / "gone"), "s3://no-such-bucket/llm/tiny")
    seen = []
    with pytest.raises(ShimError, match="no-such-bucket") as err:
        peer_files.init_worker(lambda *a, **k: seen.append(a), instance, args, {})
    assert seen == [] and "testing" not in str(err.value)  # vLLM's worker never started; no secret shown
