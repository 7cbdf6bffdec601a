"""Every import/patch order, each in a fresh interpreter (ddtrace's PatchTestCase style)."""

from __future__ import annotations

import json

from support.procs import base_env, last_json, run_python

STATE = """
import json, sys, wrapt

def state():
    W = wrapt.FunctionWrapper
    m = sys.modules.get("ray.llm._internal.batch.stages.vllm_engine_stage")
    cu = sys.modules.get("ray.llm._internal.common.utils.cloud_utils")
    ray = sys.modules.get("ray")
    out = {}
    if m is not None:
        d = m.__dict__["download_model_files"]
        out["download"] = isinstance(d, W)
        out["download_double"] = isinstance(getattr(d, "__wrapped__", None), W)
        out["udf_init"] = isinstance(m.vLLMEngineStageUDF.__dict__["__init__"], W)
        out["engine_init"] = isinstance(m.vLLMEngineWrapper.__dict__["__init__"], W)
    if cu is not None:
        out["endpoint"] = isinstance(cu.CloudFileSystem.__dict__["get_fs_and_path"], W)
    if ray is not None:
        out["ray_init"] = isinstance(ray.init, W)
    return out

def originals():
    m = sys.modules["ray.llm._internal.batch.stages.vllm_engine_stage"]
    cu = sys.modules["ray.llm._internal.common.utils.cloud_utils"]
    import ray, ray._private.worker as w
    return [m.__dict__["download_model_files"], m.vLLMEngineStageUDF.__dict__["__init__"],
            m.vLLMEngineWrapper.__dict__["__init__"], cu.CloudFileSystem.__dict__["get_fs_and_path"],
            ray.init, w.init]
"""

STAGE = "import ray.llm._internal.batch.stages.vllm_engine_stage\n"
ALL_PATCHED = {
    "download": True,
    "download_double": False,
    "udf_init": True,
    "engine_init": True,
    "endpoint": True,
    "ray_init": True,
}
NONE_PATCHED = {k: False for k in ALL_PATCHED}


def run(body: str, **env: str) -> dict:
    return last_json(run_python(STATE + body, env=base_env(env, site=False)))


def test_importing_the_shim_imports_neither_ray_nor_vllm_nor_wrapt():
    out = run(
        "import ray_runai_shim\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'vllm', 'torch', 'transformers', 'pyarrow', 'wrapt'))))"
    )
    # STATE imports wrapt itself, so only that one is allowed here.
    assert out == ["wrapt"] or out == sorted(m for m in out if m.startswith("wrapt"))


def test_shim_before_ray_patches_the_consumer_module():
    assert run("import ray_runai_shim\n" + STAGE + "print(json.dumps(state()))") == ALL_PATCHED


def test_shim_after_ray_patches_already_imported_modules():
    assert run(STAGE + "import ray_runai_shim\nprint(json.dumps(state()))") == ALL_PATCHED


def test_import_twice_and_install_twice_never_double_wraps():
    body = (
        "import ray_runai_shim\n" + STAGE + "import importlib\n"
        "ray_runai_shim.install(); ray_runai_shim.install()\n"
        "import ray_runai_shim as again\nassert again is ray_runai_shim\n"
        "print(json.dumps(state()))"
    )
    assert run(body) == ALL_PATCHED


def test_install_uninstall_install_restores_exact_originals():
    body = STAGE + (
        "before = originals()\n"
        "import ray_runai_shim\n"
        "patched = state()\n"
        "ray_runai_shim.uninstall()\n"
        "restored = [a is b for a, b in zip(originals(), before)]\n"
        "after_uninstall = state()\n"
        "ray_runai_shim.uninstall()  # twice is fine\n"
        "ray_runai_shim.install()\n"
        "print(json.dumps({'patched': patched, 'restored': restored, 'after_uninstall': after_uninstall,"
        " 'reinstalled': state(), 'status': ray_runai_shim.status()['installed']}))"
    )
    out = run(body)
    assert out["patched"] == ALL_PATCHED
    assert out["restored"] == [True] * 6
    assert out["after_uninstall"] == NONE_PATCHED
    assert out["reinstalled"] == ALL_PATCHED
    assert out["status"] is True


def test_uninstall_before_ray_is_imported_leaves_ray_untouched():
    body = "import ray_runai_shim\nray_runai_shim.uninstall()\n" + STAGE + "print(json.dumps(state()))"
    assert run(body) == NONE_PATCHED


def test_kill_switch_env_var():
    body = (
        "import ray_runai_shim\n" + STAGE + "ray_runai_shim.install()\n"
        "s = ray_runai_shim.status()\n"
        "print(json.dumps({**state(), 'disabled': s['disabled_by_env'], 'installed': s['installed']}))"
    )
    out = run(body, RAY_RUNAI_SHIM_DISABLE="1")
    assert out == {**NONE_PATCHED, "disabled": True, "installed": False}


def test_a_failing_hook_never_breaks_import_ray():
    # Simulate an unexpected Ray internal: the stage hook raises. Ray must still import and
    # run unpatched there, and the failure must be logged.
    body = (
        "import logging, io\n"
        "buf = io.StringIO(); h = logging.StreamHandler(buf)\n"
        "logging.getLogger('ray.runai_shim').addHandler(h)\n"
        "import ray_runai_shim.patches as p\n"
        "def boom(mod): raise AttributeError('vLLMEngineStageUDF moved')\n"
        "p.HOOKS = tuple((n, boom if n == p.STAGE_MODULE else f) for n, f in p.HOOKS)\n"
        "import ray_runai_shim\n" + STAGE + "import ray.data\n"
        "out = state(); out['logged'] = 'patching ray.llm._internal.batch.stages.vllm_engine_stage failed' in buf.getvalue()\n"
        "print(json.dumps(out))"
    )
    out = run(body)
    assert out["download"] is False and out["udf_init"] is False
    assert out["endpoint"] is True  # the other hooks still applied
    assert out["logged"] is True


def test_status_reports_the_plan_for_this_ray():
    out = run("import ray_runai_shim\n" + STAGE + "print(json.dumps(ray_runai_shim.status()))")
    assert out["ray_version"] == "2.48.0"
    assert set(out["plan"]) == {"batch-download", "batch-handoff", "s3-endpoint", "worker-activation"}
    assert "ray.llm._internal.batch.stages.vllm_engine_stage.download_model_files" in out["patched"]
    json.dumps(out)
