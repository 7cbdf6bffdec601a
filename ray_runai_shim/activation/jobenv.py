"""How the shim's additions join a job's runtime_env without a conflict (pure; no Ray import).

A submitted job (Jobs API, ``ray job submit``, KubeRay RayJob) hands its driver the
runtime_env it was submitted with in ``RAY_JOB_CONFIG_JSON_ENV_VAR``, and ``ray.init``
merges it with its own argument. In every supported release (2.43-2.60,
``ray._private.worker`` + ``ray.runtime_env.runtime_env._merge_runtime_env``) that merge
is per top-level field, and per key inside ``env_vars``: a field or variable present in
both is a conflict (``ValueError``) even when equal, unless ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1``,
when ``ray.init``'s value wins per field. ``image_uri``/``container`` combine only with
``env_vars`` and ``config``. So:

* fields the job does not have are added to ``ray.init``'s argument, nothing else;
* a field the job has that the shim must extend (the job's own setup hook, which is chained;
  its ``py_modules``, when the package has to ship) is passed as the union of both envs under
  the documented override, so every field of the user survives unchanged;
* where no setup hook can be added (``image_uri``, ``container``, a hook Ray already exported
  into ``env_vars``) the workers activate through the image's autoload ``.pth``
  (``RAY_RUNAI_SHIM_AUTOLOAD=1``, added to ``env_vars``) and one WARNING says what the image needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..tables import settings

SETUP_HOOK = "ray_runai_shim.activation.worker_setup"
CHAIN_ENV = settings.CHAINED_SETUP_HOOK
AUTOLOAD_ENV = settings.AUTOLOAD
#: Where Ray exports a string setup hook; present in a job's env_vars, the hook slot is taken.
RAY_HOOK_ENV = settings.RAY_WORKER_SETUP_HOOK
OVERRIDE_ENV = settings.RAY_OVERRIDE_JOB_RUNTIME_ENV
#: Fields Ray combines only with env_vars/config: no hook, no py_modules beside them.
IMAGE_FIELDS = ("image_uri", "container")


@dataclass(frozen=True)
class InitEnv:
    """What the ``ray.init`` wrapper passes on."""

    runtime_env: Optional[dict[str, Any]]
    override: bool = False  # set RAY_OVERRIDE_JOB_RUNTIME_ENV=1 for this one call
    route: str = "setup hook"  # how workers load the shim: "setup hook" | "autoload" | "none"
    added: tuple[str, ...] = ()
    forwarded: tuple[str, ...] = ()
    warning: Optional[str] = None


def _fields(env: Mapping[str, Any]) -> set[str]:
    return {k for k, v in env.items() if k != "env_vars" and v is not None}


def conflicts(job: Mapping[str, Any], user: Mapping[str, Any]) -> bool:
    """Ray's own rule: would ``ray.init(runtime_env=user)`` fail to merge with the job's env?"""
    if _fields(job) & _fields(user):
        return True
    return bool(set(job.get("env_vars") or {}) & set(user.get("env_vars") or {}))


def already_merged(job: Mapping[str, Any], user: Mapping[str, Any]) -> bool:
    """Is *user* a plan of ours built on *job* (our hook; every field and variable of the job kept)?"""
    if not _is_ours(user.get("worker_process_setup_hook")):
        return False
    for key, value in job.items():
        if key == "worker_process_setup_hook":
            continue
        if key == "env_vars":
            user_vars = user.get("env_vars") or {}
            if any(user_vars.get(k) != v for k, v in (value or {}).items()):
                return False
        elif key == "py_modules":
            if list(user.get(key) or [])[: len(value or [])] != list(value or []):
                return False
        elif user.get(key) != value:
            return False
    return True


def pip_installs_shim(env: Mapping[str, Any]) -> bool:
    """Does the env's ``pip``/``uv`` field install this package into the workers?"""
    for key in ("pip", "uv"):
        spec = env.get(key)
        packages = spec.get("packages", []) if isinstance(spec, Mapping) else spec
        if isinstance(packages, (list, tuple)) and any(
            isinstance(p, str) and "ray-runai-shim" in p.replace("_", "-").lower() for p in packages
        ):
            return True
    return False


def _is_ours(hook: Any) -> bool:
    return hook == SETUP_HOOK or bool(getattr(hook, "_ray_runai_shim", False))


def plan_init_env(
    user: Optional[Mapping[str, Any]],
    job: Optional[Mapping[str, Any]],
    *,
    ship: bool,
    package_dir: str,
    forward: Mapping[str, str],
    chain_callable: Callable[[Callable[[], Any]], Callable[[], Any]],
) -> InitEnv:
    """The runtime_env for ``ray.init`` given the user's argument and the submitted job's env.

    *ship*: the workers cannot import the package by themselves (add it as ``py_modules``).
    *forward*: endpoint/streamer settings to give the workers where nobody set them.
    """
    user_env = dict(user or {})
    job_env = dict(job or {})
    if job_env and conflicts(job_env, user_env):
        if already_merged(job_env, user_env):
            # ray.init(runtime_env=ray_runai_shim.runtime_env()) in a submitted job: the shim's own
            # plan, which already holds every field of the job's.
            return InitEnv(user_env, override=True)
        # Ray raises its own merge error, exactly as it would without the shim.
        return InitEnv(dict(user) if user is not None else None, route="none")
    merged = {**job_env, **user_env}
    merged_vars = {**(job_env.get("env_vars") or {}), **(user_env.get("env_vars") or {})}
    new_vars = {k: v for k, v in forward.items() if k not in merged_vars}
    forwarded = tuple(sorted(new_vars))
    add: dict[str, Any] = {}
    added: list[str] = []
    warning = None
    hook = merged.get("worker_process_setup_hook")
    image = [k for k in IMAGE_FIELDS if merged.get(k)]
    hook_exported = RAY_HOOK_ENV in merged_vars and not _is_ours(merged_vars[RAY_HOOK_ENV])

    if image or hook_exported:
        route = "autoload"
        why = (f"the job's runtime_env uses {image[0]}, which Ray combines only with env_vars"
               if image else "the job's setup hook is already exported into env_vars")
        if merged_vars.get(AUTOLOAD_ENV) != "1":
            if AUTOLOAD_ENV in merged_vars:
                why += f", and {AUTOLOAD_ENV}={merged_vars[AUTOLOAD_ENV]!r} turns the autoload off"
            else:
                new_vars[AUTOLOAD_ENV] = "1"
                added.append(f"env_vars {AUTOLOAD_ENV}=1")
        warning = (f"ray-runai-shim: {why}, so the shim cannot add its worker setup hook; workers load it "
                   f"only through the image's autoload: the image needs `pip install ray-runai-shim` "
                   f"(and {AUTOLOAD_ENV}=1 in the image or the job's env_vars). Without it, Ray Data and "
                   f"Serve copy the whole model.")
    else:
        route = "setup hook"
        if hook is None:
            add["worker_process_setup_hook"] = SETUP_HOOK
            added.append("worker_process_setup_hook")
        elif _is_ours(hook):
            pass
        elif isinstance(hook, str):
            add["worker_process_setup_hook"] = SETUP_HOOK
            if CHAIN_ENV not in merged_vars:
                new_vars[CHAIN_ENV] = hook
            added.append(f"worker_process_setup_hook (then {hook})")
        elif callable(hook):
            chained = chain_callable(hook)
            chained._ray_runai_shim = True  # type: ignore[attr-defined]
            add["worker_process_setup_hook"] = chained
            added.append("worker_process_setup_hook (then the user's callable)")
        if ship and not pip_installs_shim(merged):
            mods = list(merged.get("py_modules") or [])
            if package_dir not in mods:
                add["py_modules"] = [*mods, package_dir]
                added.append("py_modules (this package)")

    override = bool(set(add) & _fields(job_env))
    if override:
        out: dict[str, Any] = {**merged, **add}
        all_vars = {**merged_vars, **new_vars}
    else:
        out = {**user_env, **add}
        all_vars = {**(user_env.get("env_vars") or {}), **new_vars}
    if all_vars:
        out["env_vars"] = all_vars
    if not out and user is None:
        return InitEnv(None, route=route, warning=warning)
    return InitEnv(out, override=override, route=route, added=tuple(added), forwarded=forwarded,
                   warning=warning)
