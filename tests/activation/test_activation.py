"""The shim reaches Ray's worker processes without clobbering the user's runtime_env.

Real local Ray clusters started by ``ray.init`` (or Ray Data's auto-init) in fresh
interpreters; the verdict comes from ``ray_runai_shim.status()`` run inside the workers.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
from support.procs import base_env, last_json, run_python

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

PROBE = """
import json, os, ray

def probe():
    import sys
    loaded = "ray_runai_shim.patches" in sys.modules
    import ray_runai_shim
    # Importing the stage module in the worker is what Ray Data's actor does.
    import ray.llm._internal.batch.stages.vllm_engine_stage  # noqa: F401
    s = ray_runai_shim.status()
    return {"pid": os.getpid(), "installed": s["installed"], "file": ray_runai_shim.__file__, "patched": s["patched"],
            "user_var": os.environ.get("USER_VAR"), "hook": os.environ.get("USER_SETUP_HOOK_RAN"),
            "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
            "shim_loaded_before_probe": loaded}
"""
STAGE_PATCH = "ray.llm._internal.batch.stages.vllm_engine_stage.download_model_files"


def run(body: str, sandbox) -> dict:
    return last_json(run_python(PROBE + body, env=sandbox.env, timeout=300))


def test_driver_import_then_ray_init_patches_workers_and_keeps_the_users_runtime_env(sandbox):
    out = run(
        """
import ray_runai_shim
ray.init(num_cpus=1, include_dashboard=False, runtime_env={
    "env_vars": {"USER_VAR": "mine", "AWS_ENDPOINT_URL": "http://user-choice:9000"},
    "worker_process_setup_hook": "user_hooks.mark_worker"})
print(json.dumps(ray.get(ray.remote(probe).remote())))
""",
        sandbox,
    )
    assert out["installed"] and STAGE_PATCH in out["patched"]
    assert out["shim_loaded_before_probe"]  # by the setup hook, not by the probe
    assert out["user_var"] == "mine" and out["hook"] == "string-hook"
    assert out["endpoint"] == "http://user-choice:9000"  # the user's value wins over forwarding


def test_a_callable_user_hook_still_runs(sandbox):
    out = run(
        """
import ray_runai_shim
def my_hook():
    os.environ["USER_SETUP_HOOK_RAN"] = "callable-hook"
ray.init(num_cpus=1, include_dashboard=False, runtime_env={"worker_process_setup_hook": my_hook})
print(json.dumps(ray.get(ray.remote(probe).remote())))
""",
        sandbox,
    )
    assert out["installed"] and out["hook"] == "callable-hook" and out["shim_loaded_before_probe"]


def test_ray_datas_auto_init_carries_the_shim_into_map_actors(sandbox):
    out = run(
        """
import ray_runai_shim, ray.data
class Probe:
    def __call__(self, batch):
        return {"r": [json.dumps(probe())]}
rows = ray.data.from_items([1]).map_batches(Probe, concurrency=1, batch_size=1).take_all()
r = json.loads(rows[0]["r"]); r["driver_pid"] = os.getpid()
print(json.dumps(r))
""",
        sandbox,
    )
    assert out["pid"] != out["driver_pid"]
    assert out["installed"] and STAGE_PATCH in out["patched"] and out["shim_loaded_before_probe"]
    assert out["endpoint"] == sandbox.env["AWS_ENDPOINT_URL"]


def test_ray_initialised_before_the_import_warns_and_runtime_env_helper_fixes_it(sandbox):
    proc = run_python(
        PROBE
        + """
ray.init(num_cpus=1, include_dashboard=False)
import ray_runai_shim
late = ray.get(ray.remote(probe).remote())
ray.shutdown()
ray.init(num_cpus=1, include_dashboard=False, runtime_env=ray_runai_shim.runtime_env())
print(json.dumps({"late": late, "fixed": ray.get(ray.remote(probe).remote())}))
""",
        env=sandbox.env,
    )
    out = last_json(proc)
    assert "Ray was initialized before ray_runai_shim was imported" in proc.stderr + proc.stdout
    assert out["late"]["shim_loaded_before_probe"] is False
    assert out["fixed"]["shim_loaded_before_probe"] is True and out["fixed"]["installed"]


@pytest.mark.parametrize("flag", ["1", "true"])
def test_kill_switch_keeps_ray_init_untouched(sandbox, flag):
    out = run(
        """
import ray_runai_shim
ray.init(num_cpus=1, include_dashboard=False)
print(json.dumps({**ray.get(ray.remote(probe).remote()), "init_wrapped": type(ray.init).__name__}))
""",
        dataclasses.replace(sandbox, env={**sandbox.env, "RAY_RUNAI_SHIM_DISABLE": flag}),
    )
    assert out["init_wrapped"] == "function"
    assert out["shim_loaded_before_probe"] is False and out["installed"] is False


# CI time (#37): in test-all; test_jobs.py's pip job installs the same built wheel through a
# runtime_env in CI.
@pytest.mark.extended
def test_runtime_env_pip_dependency_activates_workers_without_a_driver_import(sandbox, built):
    """``runtime_env={"pip": [...]}``: Ray builds a virtualenv with the wheel; its ``.pth``
    loads the shim at worker start when RAY_RUNAI_SHIM_AUTOLOAD=1, and keeps the variable so
    the processes it starts (on an image: ``ray start``'s daemons and workers) have it too."""
    [wheel] = built.glob("*.whl")
    out = run(
        f"""
ray.init(num_cpus=1, include_dashboard=False, runtime_env={{
    "pip": [{str(wheel)!r}], "env_vars": {{"RAY_RUNAI_SHIM_AUTOLOAD": "1"}}}})
r = ray.get(ray.remote(probe).remote())
import sys
r["driver_imported"] = "ray_runai_shim" in sys.modules
r["autoload_env"] = ray.get(ray.remote(lambda: os.environ.get("RAY_RUNAI_SHIM_AUTOLOAD")).remote())
print(json.dumps(r))
""",
        sandbox,
    )
    assert out["driver_imported"] is False
    assert out["shim_loaded_before_probe"] and out["installed"] and STAGE_PATCH in out["patched"]
    assert out["autoload_env"] == "1"
    assert "/runtime_resources/pip/" in out["file"]  # the copy Ray installed from the wheel


def test_the_banner_is_said_by_drivers_only_not_by_rays_own_processes(tmp_path):
    """With the shim loaded in every interpreter (sitecustomize / autoload on an image), Ray's
    daemons and workers -- scripts inside Ray's package -- must not repeat the INFO line."""
    import ray as _ray

    ray_dir = Path(_ray.__file__).resolve().parent
    lines = {}
    cli = Path(sys.executable).with_name("ray")
    for label, argv0 in (("daemon", ray_dir / "_private" / "log_monitor.py"), ("cli", cli), ("driver", tmp_path / "job.py")):
        code = f"import sys\nsys.argv[0] = {str(argv0)!r}\nimport ray_runai_shim, ray\n"
        proc = run_python(code, env=base_env(site=False))
        lines[label] = [ln for ln in proc.stderr.splitlines() if "ray-runai-shim" in ln and "Ray 2." in ln]
    assert lines["daemon"] == [] and lines["cli"] == []  # `ray start` on an image is not a job's driver
    assert len(lines["driver"]) == 1 and re.search(r"\sINFO\s", lines["driver"][0])
