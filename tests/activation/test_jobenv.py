"""The merge plan for a submitted job's runtime_env, checked against Ray's own merge.

Every case is fed to the installed Ray's ``_merge_runtime_env`` exactly as ``ray.init``
does it (override only when the plan asks), so "no conflict" and "the user's fields are
intact" are Ray's verdicts, not ours. The Jobs API end to end is in test_jobs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.runtime_env.runtime_env import RuntimeEnv, _merge_runtime_env

import ray_runai_shim
from ray_runai_shim.activation.jobenv import (
    AUTOLOAD_ENV,
    CHAIN_ENV,
    RAY_HOOK_ENV,
    SETUP_HOOK,
    conflicts,
    pip_installs_shim,
    plan_init_env,
)

PKG = str(Path(ray_runai_shim.__file__).parent)  # Ray validates local paths
WD = "gcs://_ray_pkg_wd.zip"
MODS = ["gcs://_ray_pkg_mods.zip"]


def chain(hook):
    def chained():
        return hook()

    return chained


def plan(user, job, *, ship=False, forward=None):
    return plan_init_env(user, job, ship=ship, package_dir=PKG, forward=forward or {}, chain_callable=chain)


def ray_merge(job, p):
    """What ray.init does with the job's env and the plan's (None: Ray's conflict error)."""
    return _merge_runtime_env(RuntimeEnv(**job) if job else None,
                              RuntimeEnv(**p.runtime_env) if p.runtime_env else None, override=p.override)


JOBS = {
    "none": {},
    "env_vars": {"env_vars": {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}},
    "working_dir": {"working_dir": WD},
    "working_dir+py_modules": {"working_dir": WD, "py_modules": MODS},
    "working_dir+own hook": {"working_dir": WD, "worker_process_setup_hook": "usermod.hook"},
    "working_dir+py_modules+own hook": {"working_dir": WD, "py_modules": MODS,
                                        "worker_process_setup_hook": "usermod.hook", "env_vars": {"A": "1"}},
}


@pytest.mark.parametrize("ship", [False, True], ids=["installed", "shipped"])
@pytest.mark.parametrize("name", list(JOBS))
def test_every_job_shape_merges_and_keeps_the_users_fields(name, ship):
    job = JOBS[name]
    p = plan(None, job, ship=ship, forward={"RUNAI_STREAMER_CONCURRENCY": "4"})
    merged = ray_merge(job, p)
    assert merged is not None, f"Ray would raise its merge ValueError for {p}"
    for key, value in job.items():
        if key == "env_vars":
            assert {k: merged["env_vars"][k] for k in value} == value
        elif key == "py_modules":
            assert merged["py_modules"][: len(value)] == value
        elif key != "worker_process_setup_hook":
            assert merged[key] == value
    assert merged["worker_process_setup_hook"] == SETUP_HOOK
    if "worker_process_setup_hook" in job:
        assert merged["env_vars"][CHAIN_ENV] == job["worker_process_setup_hook"]  # theirs runs after ours
    assert (PKG in (merged.get("py_modules") or [])) == ship
    assert merged["env_vars"]["RUNAI_STREAMER_CONCURRENCY"] == "4"
    # Override only where the plan must extend a field the job already has.
    assert p.override == ("worker_process_setup_hook" in job or (ship and "py_modules" in job))


def test_without_a_job_the_users_env_gains_only_the_hook():
    p = plan({"env_vars": {"X": "1"}, "pip": ["requests"]}, None)
    assert p.runtime_env == {"env_vars": {"X": "1"}, "pip": ["requests"], "worker_process_setup_hook": SETUP_HOOK}
    assert not p.override and p.route == "setup hook"


def test_forwarded_settings_never_override_the_job_or_the_user():
    job = {"env_vars": {"AWS_ENDPOINT_URL": "http://job:1"}}
    p = plan({"env_vars": {"AWS_REGION": "user"}}, job,
             forward={"AWS_ENDPOINT_URL": "http://driver:2", "AWS_REGION": "driver", "RUNAI_STREAMER_X": "1"})
    merged = ray_merge(job, p)
    assert merged["env_vars"] == {"AWS_ENDPOINT_URL": "http://job:1", "AWS_REGION": "user", "RUNAI_STREAMER_X": "1"}
    assert p.forwarded == ("RUNAI_STREAMER_X",)


def test_a_conflict_of_the_users_own_making_is_left_to_ray(tmp_path):
    job = {"working_dir": WD}
    p = plan({"working_dir": str(tmp_path)}, job)
    assert p.route == "none" and p.runtime_env == {"working_dir": str(tmp_path)}
    assert ray_merge(job, p) is None  # Ray's own ValueError, as without the shim
    assert conflicts({"env_vars": {"A": "1"}}, {"env_vars": {"A": "1"}})


def test_users_callable_hook_is_chained_once():
    calls = []
    p = plan({"worker_process_setup_hook": lambda: calls.append("user")}, None)
    hook = p.runtime_env["worker_process_setup_hook"]
    assert getattr(hook, "_ray_runai_shim", False)
    hook()
    assert calls == ["user"]
    again = plan(p.runtime_env, None)  # already ours: not chained twice
    assert again.runtime_env["worker_process_setup_hook"] is hook


@pytest.mark.parametrize("where", ["job", "user"])
def test_image_uri_gets_env_vars_only_and_one_warning_saying_what_the_image_needs(where):
    image = {"image_uri": "registry.example/llm:1", "env_vars": {"A": "1"}}
    job, user = (image, None) if where == "job" else (None, image)
    p = plan(user, job, ship=True)
    merged = ray_merge(job, p) if job else p.runtime_env
    RuntimeEnv(**merged)  # Ray's own validation: image_uri with anything but env_vars/config raises
    assert set(merged) == {"image_uri", "env_vars"}
    assert merged["env_vars"][AUTOLOAD_ENV] == "1" and merged["env_vars"]["A"] == "1"
    assert p.route == "autoload" and "pip install ray-runai-shim" in p.warning and "image_uri" in p.warning


def test_ray_rejects_a_hook_next_to_image_uri_so_the_plan_must_not_add_one():
    """The control: what the shim used to add."""
    with pytest.raises(ValueError, match="image_uri"):
        RuntimeEnv(image_uri="registry.example/llm:1", worker_process_setup_hook=SETUP_HOOK)


def test_an_exported_hook_takes_the_slot_and_the_autoload_is_used():
    job = {"env_vars": {RAY_HOOK_ENV: "usermod.hook"}}
    p = plan(None, job)
    assert p.route == "autoload" and "worker_process_setup_hook" not in (p.runtime_env or {})
    assert ray_merge(job, p)["env_vars"][AUTOLOAD_ENV] == "1"


def test_autoload_turned_off_by_the_user_is_respected_and_said():
    p = plan({"image_uri": "x:1", "env_vars": {AUTOLOAD_ENV: "0"}}, None)
    assert p.runtime_env["env_vars"][AUTOLOAD_ENV] == "0" and "turns the autoload off" in p.warning


@pytest.mark.parametrize("env, expected", [
    ({"pip": ["ray-runai-shim==0.2.0"]}, True),
    ({"pip": {"packages": ["ray_runai_shim[s3]"]}}, True),
    ({"uv": ["requests", "ray-runai-shim"]}, True),
    ({"pip": ["requests"]}, False),
    ({}, False),
])
def test_a_pip_field_that_installs_the_shim_means_no_py_modules(env, expected):
    assert pip_installs_shim(env) is expected
    p = plan(env, None, ship=True)
    assert ("py_modules" in p.runtime_env) is not expected


def test_the_shims_own_runtime_env_helper_output_passes_through_a_submitted_job():
    """``ray.init(runtime_env=ray_runai_shim.runtime_env())`` in an own-hook job: the helper's plan
    already holds the job's fields; the ray.init wrapper passes it on under the override."""
    job = JOBS["working_dir+py_modules+own hook"]
    helper = plan(None, job, ship=True).runtime_env
    again = plan(helper, job, ship=True)
    assert again.override and again.runtime_env == helper
    merged = ray_merge(job, again)
    assert merged["env_vars"][CHAIN_ENV] == "usermod.hook" and merged["py_modules"][:1] == MODS
    changed = {**helper, "env_vars": {**helper["env_vars"], "A": "other"}}  # not the job's value
    assert plan(changed, job).route == "none"  # a real conflict: left to Ray
