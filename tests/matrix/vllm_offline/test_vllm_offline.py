"""vLLM 0.10.2-0.22 with ``HF_HUB_OFFLINE=1``: an object-store model becomes a Hub lookup (#27 item 6).

Runs only inside a layer built by ``tests/matrix/vllm_envs.py`` (vLLM 0.13.0 + Ray 2.53.0,
vLLM 0.15.1 + Ray 2.54.1):

    python tests/matrix/vllm_envs.py 0.15.1      # nox -s vllm-0.15.1

What is real: the moto S3 server and the tiny models in it, the layer's Ray (whose version picks
the shim's patches), that vLLM's ``EngineArgs`` (its ``__post_init__`` offline lookup, its
``create_engine_config``, its own pull where it pulls) and its runai loader streaming the weights,
``huggingface_hub`` with ``HF_HUB_OFFLINE=1`` read at import. Each case is a fresh process
(``offline_worker.py``). The engine itself cannot start here (the CUDA wheel's kernels do not
load), so the weights are streamed by vLLM's own loader on the config those args built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from support.details import record
from support.diskscan import find_weight_bytes

vllm = pytest.importorskip("vllm")
VLLM = tuple(int(p) for p in vllm.__version__.split(".")[:2])
if not ((0, 10) <= VLLM < (0, 23)):
    pytest.skip("the offline Hub lookup of object-store URIs is in vLLM 0.10.2-0.22 only", allow_module_level=True)

WORKER = Path(__file__).with_name("offline_worker.py")
TARGET = "vllm.engine.arg_utils.get_model_path"


@pytest.fixture
def node(s3):
    """One node's private HOME/HF/vLLM caches, pointed at moto, offline for the Hub."""
    root = Path(tempfile.mkdtemp(prefix="rrs-offline-", dir="/tmp"))
    for d in ("home", "hf", "cache", "tmp"):
        (root / d).mkdir()
    env = {**os.environ, **s3.env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HOME": str(root / "home"), "HF_HOME": str(root / "hf"), "XDG_CACHE_HOME": str(root / "cache"),
           "TMPDIR": str(root / "tmp")}
    yield root, env
    shutil.rmtree(root, ignore_errors=True)


def run(root: Path, env: dict[str, str], model, mode: str) -> dict[str, Any]:
    out = root / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, str(WORKER), model.uri, mode, str(out), *map(str, model.weight_paths().values())],
        env=env, cwd=str(root), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["hf_hub_offline"] is True, result  # the Hub client really is offline
    return result


def get_counts(s3, since: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in s3.requests(since):
        if r.method == "GET" and r.status in (200, 206):
            counts[r.path] = counts.get(r.path, 0) + 1
    return counts


def test_control_this_vllm_alone_looks_the_uri_up_on_the_hub(s3, models, node):
    root, env = node
    model = models["tiny"]
    mark = len(s3.requests())
    res = run(root, env, model, "none")
    record("offline_control", {k: res.get(k) for k in ("stages", "error", "frames")})
    assert res["stages"] == [], res  # EngineArgs(...) itself failed
    assert res["error"].startswith("huggingface_hub.errors.HFValidationError: Repo id must be in the form"), res
    assert model.uri in res["error"], res
    frames = " | ".join(res["frames"])
    assert "vllm/engine/arg_utils.py" in frames and "__post_init__" in frames and "get_model_path" in frames, frames
    assert get_counts(s3, mark) == {}, "the store was never reached"


def test_with_the_shim_the_uri_stays_and_the_weights_stream(s3, models, node):
    root, env = node
    model = models["tiny-sharded"]
    mark = len(s3.requests())
    res = run(root, env, model, "shim")
    record("offline_with_shim", {k: res.get(k) for k in ("stages", "error", "model", "model_weights", "tensors",
                                                         "tensors_equal", "tensors_expected", "patched")})
    assert TARGET in res["patched"], res["patched"]
    assert res.get("error") is None, res
    assert res["args_model"] == model.uri  # no Hub lookup: the URI reaches create_engine_config
    assert res["model_weights"] == model.uri
    assert res["tensors"] == res["tensors_equal"] == res["tensors_expected"] > 0, res
    weight_gets = {p for p in get_counts(s3, mark) if p.endswith(".safetensors")}
    assert weight_gets, "the weights were streamed from the store"
    assert find_weight_bytes([root], model.weight_paths()) == []
