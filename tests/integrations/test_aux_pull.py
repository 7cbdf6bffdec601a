"""``aux_pull``: the locked non-weight fetch and handoff in vLLM's ``create_engine_config``.

The race itself (vLLM 0.11-0.15, several engines at once) and its control run in layered
envs holding those releases (``tests/matrix/vllm_race/``; nox ``vllm-0.13.0``,
``vllm-0.15.1``). Here: the version gate on this venv's vLLM 0.32, which has the fix and
so is never patched, and the step itself, its hook applied by hand to vLLM 0.32's real
``EngineArgs`` against moto (the ``model_weights`` route, as on 0.14-0.15), with the cases
it must leave alone.
"""

from __future__ import annotations

import pytest
from support.procs import last_json, run_python

from ray_runai_shim import patches
from ray_runai_shim.tables import targets
from ray_runai_shim.tables.support import AUX_PULL, VLLM_AUX_PULL_RACE


def test_the_target_is_limited_to_the_vllm_releases_with_the_race():
    [target] = [t for t in targets.TARGETS if t.patch == AUX_PULL]
    assert target.only_for == ("vllm", *VLLM_AUX_PULL_RACE) == ("vllm", (0, 11), (0, 16))
    import vllm

    assert patches._outside(target.only_for) == f"vllm {vllm.__version__} is outside 0.11-0.15"
    assert patches._outside(("ray_runai_shim_no_such_package", (0, 1), (0, 2))) == (
        "ray_runai_shim_no_such_package is not installed")
    assert patches._outside(("pytest", (1, 0), (99, 0))) is None
    assert patches._outside(()) is None


PROBE = """
import json, os
import ray_runai_shim
from ray_runai_shim.integrations import engine_config
from ray_runai_shim import registry
import vllm.engine.arg_utils as au
# the engine-config hook with only the aux-pull step on (this vLLM has the fix: the table would not)
registry.wrap("vllm-aux-pull", engine_config.NAME, au, "EngineArgs.create_engine_config", engine_config.create_engine_config)
out = {{}}
def build(name, **kw):
    args = au.EngineArgs(load_format="runai_streamer", dtype="float32", max_model_len=256, enforce_eager=True, **kw)
    try:
        mc = args.create_engine_config().model_config
        out[name] = {{"model": mc.model, "tokenizer": mc.tokenizer, "model_weights": mc.model_weights,
                     "served": mc.served_model_name}}
    except Exception as e:
        out[name] = {{"error": f"{{type(e).__name__}}: {{e}}"[:300]}}
build("uri", model={uri!r})
build("named", model={uri!r}, served_model_name="mine")
build("local", model={local!r})
pulled = os.path.join(os.environ["XDG_CACHE_HOME"], "vllm", "assets", "model_streamer")
out["vllm_pulled"] = sorted(os.listdir(pulled)) if os.path.isdir(pulled) else []
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_wrapper_fetches_once_and_hands_vllm_the_dir_and_the_uri(s3, models, sandbox):
    model = models["tiny"]
    sandbox.env.pop("HF_HUB_OFFLINE", None)
    mark = len(s3.requests())
    out = last_json(run_python(PROBE.format(uri=model.uri, local=str(model.local)), env=sandbox.env))
    [shim_dir] = sandbox.shim_dirs()
    assert out["uri"] == {"model": str(shim_dir), "tokenizer": str(shim_dir), "model_weights": model.uri,
                          "served": model.uri}, out
    assert out["named"]["served"] == "mine" and out["named"]["model"] == str(shim_dir), out
    assert out["local"]["model"] == str(model.local) and not out["local"]["model_weights"], out  # left alone
    # Only the wrapped builds reached vLLM's config without vLLM pulling: its own pull dir is empty.
    assert out["vllm_pulled"] == [], out
    gets = [r.path for r in s3.requests(mark) if r.method == "GET" and r.path.count("/") > 1]
    assert sorted(gets) == sorted(f"/models/llm/tiny/{f}" for f in model.nonweights)  # each once, no weights
    assert sandbox.weight_bytes_on_disk(model) == []
