"""vLLM 0.11-0.15: engines starting together on one node race on vLLM's own pull (ray#60681).

Runs only inside a layer built by ``tests/matrix/vllm_envs.py`` (vLLM 0.15.1 + Ray 2.54.1):

    python tests/matrix/vllm_envs.py 0.15.1

What is real: the moto S3 server and the tiny models in it, Ray 2.54.1 (whose
version picks the shim's patches), vLLM 0.15.1's ``EngineArgs.create_engine_config``
with its own ``ObjectStorageModel`` pull through the Run:ai streamer, the shim's
wrapper and fetch, vLLM's runai loader streaming the weights. N worker processes
(``race_worker.py``) build their engine config at the same moment, round after
round: the part of an engine's start where vLLM pulls. The engine itself cannot
start here (the CUDA wheel's kernels do not load), so the weights are streamed by
vLLM's own loader on the config the shim's args built, in this process.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.details import record
from support.diskscan import find_weight_bytes
from support.fixtures import BUCKET, public_copy
from support.vllm_loader import load_with_vllm_loader

vllm = pytest.importorskip("vllm")
if not ((0, 11) <= tuple(int(p) for p in vllm.__version__.split(".")[:2]) < (0, 16)):
    pytest.skip("the aux-pull race is in vLLM 0.11-0.15 only", allow_module_level=True)

import ray_runai_shim  # noqa: E402

WORKER = Path(__file__).with_name("race_worker.py")
N, ROUNDS = 4, 10
TARGET = "vllm.engine.arg_utils.EngineArgs.create_engine_config"


@pytest.fixture
def node(s3, tmp_path):
    """One node's private HOME/HF/vLLM caches, pointed at moto."""
    root = Path(tempfile.mkdtemp(prefix="rrs-race-", dir="/tmp"))
    for d in ("home", "hf", "cache", "tmp", "sync"):
        (root / d).mkdir()
    # No HF_HUB_OFFLINE: vLLM 0.10.2-0.22's EngineArgs turn an s3:// model into a Hub lookup under it
    # (the shim's vllm-offline-uri fixes that; tests/matrix/vllm_offline/). Here: the race alone.
    env = {**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}, **s3.env(),
           "HOME": str(root / "home"), "HF_HOME": str(root / "hf"), "XDG_CACHE_HOME": str(root / "cache"),
           "TMPDIR": str(root / "tmp")}
    yield root, env
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def start_engines(root: Path, env: dict[str, str], uri: str, shim: bool) -> list[dict[str, Any]]:
    procs, outs = [], []
    for i in range(N):
        out = root / f"worker-{i}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(root / "sync"), str(i), str(N), str(ROUNDS), uri, "1" if shim else "0",
             str(out)], env=env, cwd=str(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(o.read_text()) for o in outs]


def get_counts(s3, since: int) -> collections.Counter:
    return collections.Counter(r.path for r in s3.requests(since) if r.method == "GET" and r.status in (200, 206))


def test_control_engines_starting_together_race_without_the_shim(s3, models, node):
    """This vLLM alone: each config build wipes and re-creates the shared pull directory."""
    root, env = node
    model = models["tiny"]
    runs = start_engines(root, env, model.uri, shim=False)
    results = [res for run in runs for res in run["results"]]
    errors = [res["error"] for res in results if not res["ok"]]
    kinds = collections.Counter(e.split(":")[0] for e in errors)
    record("control", {"engines": N, "rounds": ROUNDS, "failed": len(errors), "kinds": dict(kinds),
                       "first_error": errors[0] if errors else None, "errors": sorted(set(errors))[:8]})
    assert errors, "no engine start failed: the race did not show in this run"
    # Each failure is the race: makedirs on the directory another engine just made
    # (FileExistsError, ray#60681's error), or a file another engine's rmtree just removed.
    pull_dir = str(root / "cache" / "vllm" / "assets" / "model_streamer")
    names = {Path(f).name for f in model.nonweights} | {Path(f).parent.name for f in model.nonweights}
    for e in errors:
        quoted = e.rstrip("'").rsplit("'", 1)[-1]
        assert (e.startswith("FileExistsError") and quoted.startswith(pull_dir)) or (
            e.startswith("FileNotFoundError") and (Path(quoted).name in names or quoted.startswith(pull_dir))), e
    assert (root / "cache" / "vllm" / "assets" / "model_streamer").is_dir()  # vLLM's own pull dir


def test_with_the_shim_every_engine_starts_and_each_object_is_fetched_once(s3, models, node):
    root, env = node
    model = models["tiny"]
    mark = len(s3.requests())
    runs = start_engines(root, env, model.uri, shim=True)
    gets = get_counts(s3, mark)
    results = [res for run in runs for res in run["results"]]
    record("with_shim", {"engines": N, "rounds": ROUNDS, "failed": sum(not r["ok"] for r in results),
                         "gets": dict(gets), "model": results[0].get("model")})
    assert all(TARGET in run["patched"] for run in runs), [run["patched"] for run in runs]
    assert [r.get("error") for r in results if not r["ok"]] == []
    dirs = {r["model"] for r in results}
    assert len(dirs) == 1, dirs  # one node-shared snapshot for every engine
    (local_dir,) = dirs
    assert local_dir.startswith(str(root / "hf" / "hub" / "ray-runai-shim")), local_dir
    assert {r["model_weights"] for r in results} == {model.uri}
    assert {r["tokenizer"] for r in results} == {local_dir}
    assert {r["served_model_name"] for r in results} == {model.uri}  # the name vLLM would have used
    for r in results:
        assert set(model.nonweights) <= set(r["files_after"]), r["files_after"]
    # vLLM never pulled: its racy directory was never made.
    assert not (root / "cache" / "vllm" / "assets" / "model_streamer").exists()
    prefix = f"/{BUCKET}/llm/{model.name}/"
    assert {p[len(prefix):]: c for p, c in gets.items() if p.startswith(prefix)} == {f: 1 for f in model.nonweights}
    assert find_weight_bytes([root], model.weight_paths()) == []


# Signed first: the anonymous case leaves RUNAI_STREAMER_S3_UNSIGNED=1 in this process, as in an engine's.
@pytest.mark.parametrize("access", ["signed", "anonymous"])
def test_the_handed_off_config_streams_the_weights_with_vllms_loader(access, s3, models, node, monkeypatch):
    """In this process: the shim's args build a config twice (as Ray does), vLLM's loader streams it.

    ``anonymous``: Ray's ``s3://anonymous@`` spelling of a public bucket, with no credentials at
    all; the fetch is unsigned (Ray's filesystem) and so is the stream (the streamer's switch).
    """
    root, env = node
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k in ("HOME", "HF_HOME", "XDG_CACHE_HOME", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"):
        monkeypatch.setenv(k, env[k])
    model = models["tiny-sharded"]
    uri = weights_uri = model.uri
    if access == "anonymous":
        weights_uri = public_copy(s3, model)
        uri = weights_uri.replace("s3://", "s3://anonymous@", 1)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(k)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    import ray  # noqa: F401

    ray_runai_shim.install()
    from vllm.engine.arg_utils import EngineArgs

    assert TARGET in ray_runai_shim.status()["patched"]
    args = EngineArgs(model=uri, load_format="runai_streamer", dtype="float32", max_model_len=256,
                      enforce_eager=True)
    first = args.create_engine_config()
    config = args.create_engine_config()  # Ray's second build from the same args
    assert config.model_config.model == first.model_config.model
    assert config.model_config.model_weights == weights_uri
    if access == "anonymous":
        assert os.environ.get("RUNAI_STREAMER_S3_UNSIGNED") == "1"
    _loader, recorder = load_with_vllm_loader(config)
    expected: dict[str, torch.Tensor] = {}
    for path in model.weight_paths().values():
        expected.update(load_file(str(path)))
    assert set(recorder.streamed) == set(expected)
    assert all(torch.equal(recorder.streamed[k], expected[k]) for k in expected)
    assert find_weight_bytes([root], model.weight_paths()) == []
    record(f"streamed_{access}", {"tensors": len(recorder.streamed), "model": config.model_config.model})
