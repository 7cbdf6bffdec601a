"""Submitted jobs: the real Jobs API (the dashboard's job server, ``JobSubmissionClient``).

Each row of issue #12's table is a job whose entrypoint starts with ``import ray_runai_shim``
and whose runtime_env has the user's own fields. A job worker reports, without importing
the shim itself, whether the shim was loaded there and whether Ray Data's vLLM stage
module is patched, plus what the user's fields did (their hook's run count, their
module, their env var). The control shows Ray's merge rule the shim has to respect.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from support.cluster import RayCluster
from support.procs import base_env

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

ENTRY = '''
import ray_runai_shim  # the README's first line
import json, os, sys
import ray

ray.init()

@ray.remote
def probe():
    shim_loaded = "ray_runai_shim" in sys.modules  # before anything here imports it
    import ray.llm._internal.batch.stages.vllm_engine_stage as stage
    try:
        import usermod
        usermod = usermod.__name__
    except ImportError:
        usermod = None
    return {"shim_loaded": shim_loaded, "stage_download": type(stage.download_model_files).__name__,
            "hook_runs": os.environ.get("USER_HOOK_RUNS"), "user_var": os.environ.get("USER_VAR"),
            "endpoint": os.environ.get("AWS_ENDPOINT_URL"), "usermod": usermod,
            "in_working_dir": os.path.exists("entry.py"),
            "runtime_env_keys": sorted(ray.get_runtime_context().runtime_env.keys())}

print("RESULT " + json.dumps(ray.get(probe.remote())))
'''
HOOK = '''
import os

def hook():
    os.environ["USER_HOOK_RUNS"] = str(int(os.environ.get("USER_HOOK_RUNS", "0")) + 1)
'''
CONTROL = '''
import os, ray
# What the shim used to add to ray.init, with the shim switched off: Ray's own merge rule.
ray.init(runtime_env={"py_modules": [os.environ["SHIM_PKG"]],
                      "worker_process_setup_hook": "ray_runai_shim.activation.worker_setup"})
'''
PATCHED = ("FunctionWrapper", "BoundFunctionWrapper")
PY = sys.executable  # the cluster's interpreter (this venv), as an image's `python` would be


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    wd = root / "wd"
    wd.mkdir()
    (wd / "entry.py").write_text(ENTRY)
    (wd / "wd_hook.py").write_text(HOOK)
    (wd / "control.py").write_text(CONTROL)
    mod = root / "mods" / "usermod"
    mod.mkdir(parents=True)
    (mod / "__init__.py").write_text(HOOK)
    return {"wd": str(wd), "usermod": str(mod), "entry": str(wd / "entry.py")}


@pytest.fixture(scope="module")
def client():
    from ray.job_submission import JobSubmissionClient

    with RayCluster(base_env(site=False), dashboard=True) as cluster:
        cluster.start_head("--num-cpus=2")
        deadline = time.monotonic() + 60
        while True:
            try:
                yield JobSubmissionClient(cluster.dashboard_url)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def run_job(client, entrypoint: str, runtime_env: dict, env_vars: dict | None = None) -> tuple[str, str]:
    if env_vars:
        runtime_env = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **env_vars}}
    deadline = time.monotonic() + 90
    while True:  # right after `ray start`, the job agent may not be registered yet
        try:
            job = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env or None)
            break
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2)
    deadline = time.monotonic() + 180
    while not (status := client.get_job_status(job)).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(0.5)
    return str(status), client.get_job_logs(job)


def result(logs: str) -> dict:
    for line in reversed(logs.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(logs[-4000:])


ROWS = {
    "none": {},
    "env_vars": {"env_vars": {"USER_VAR": "mine", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}},
    "working_dir": {"working_dir": "WD"},
    "working_dir+py_modules": {"working_dir": "WD", "py_modules": ["USERMOD"]},
    "working_dir+own_hook": {"working_dir": "WD", "worker_process_setup_hook": "wd_hook.hook"},
    "working_dir+py_modules+own_hook": {"working_dir": "WD", "py_modules": ["USERMOD"],
                                        "worker_process_setup_hook": "usermod.hook",
                                        "env_vars": {"USER_VAR": "mine"}},
}


def resolve(spec: dict, files: dict) -> dict:
    text = json.dumps(spec).replace('"WD"', json.dumps(files["wd"])).replace('"USERMOD"', json.dumps(files["usermod"]))
    return json.loads(text)


@pytest.mark.parametrize("row", list(ROWS))
def test_every_job_runtime_env_keeps_its_fields_and_gets_the_shim(client, files, row):
    spec = resolve(ROWS[row], files)
    entry = f"{PY} entry.py" if "working_dir" in spec else f"{PY} {files['entry']}"
    status, logs = run_job(client, entry, spec)
    assert status == "SUCCEEDED", logs[-4000:]
    out = result(logs)
    assert out["shim_loaded"] and out["stage_download"] in PATCHED, out  # active in the job's worker
    if "worker_process_setup_hook" in spec:
        assert out["hook_runs"] == "1", out  # the user's own hook ran, once
    else:
        assert out["hook_runs"] is None
    assert out["user_var"] == spec.get("env_vars", {}).get("USER_VAR")
    assert out["in_working_dir"] == ("working_dir" in spec)
    assert (out["usermod"] == "usermod") == ("py_modules" in spec)
    if row == "env_vars":
        assert out["endpoint"] == "http://127.0.0.1:9"  # the job's value, not replaced
    # Installed on this cluster: the package is never shipped as py_modules.
    assert "py_modules (this package)" not in logs
    assert "Failed to merge" not in logs


def test_control_rays_merge_rejects_what_the_shim_used_to_add(client, files):
    import ray_runai_shim

    spec = resolve(ROWS["working_dir+py_modules+own_hook"], files)
    status, logs = run_job(client, f"{PY} control.py", spec,
                           {"RAY_RUNAI_SHIM_DISABLE": "1", "SHIM_PKG": str(Path(ray_runai_shim.__file__).parent)})
    assert status == "FAILED"
    assert "Failed to merge the Job's runtime env" in logs


def test_control_without_the_shim_an_own_hook_job_is_not_streaming(client, files):
    spec = resolve(ROWS["working_dir+own_hook"], files)
    status, logs = run_job(client, f"{PY} entry.py", spec, {"RAY_RUNAI_SHIM_DISABLE": "1"})
    assert status == "SUCCEEDED", logs[-3000:]
    out = result(logs)
    assert out["hook_runs"] == "1" and out["stage_download"] not in PATCHED


def test_a_pip_job_installs_the_shim_itself_and_nothing_is_shipped(client, files, built):
    """``runtime_env={"pip": [the wheel]}``: the entrypoint imports the copy Ray installed into the job's
    virtualenv, and the workers have it there too: the shim adds its hook, never ``py_modules``."""
    [wheel] = built.glob("*.whl")
    spec = {"working_dir": files["wd"], "pip": [str(wheel)]}
    status, logs = run_job(client, f"{PY} entry.py", spec)
    assert status == "SUCCEEDED", logs[-4000:]
    out = result(logs)
    assert out["shim_loaded"] and out["stage_download"] in PATCHED, out
    assert "pip" in out["runtime_env_keys"] and "py_modules" not in out["runtime_env_keys"], out
    assert "py_modules (this package)" not in logs
