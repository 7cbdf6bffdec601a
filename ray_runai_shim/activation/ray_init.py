"""Carry the shim from the driver into the processes where Ray builds the stage.

Ray Data constructs ``vLLMEngineStageUDF`` inside map-actor processes, which
import a pristine ``ray.llm``. The one Ray mechanism that runs code in every
worker of a job before any task is ``runtime_env["worker_process_setup_hook"]``,
and Ray honours it only at job level, i.e. in ``ray.init``. So the shim wraps
``ray.init`` and merges into the job's runtime_env -- never overwriting what the
user set:

* ``worker_process_setup_hook``: ours, chaining to the user's own hook if any;
* ``env_vars``: endpoint/streamer settings the driver has, set-if-absent;
* ``py_modules``: this package, only when workers could not import it otherwise.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from ..failopen import fail_open
from ..log import logger
from ..processes import in_ray_worker
from ..tables import settings
from .jobenv import CHAIN_ENV, OVERRIDE_ENV, RAY_HOOK_ENV, SETUP_HOOK, InitEnv, plan_init_env

__all__ = ["CHAIN_ENV", "RAY_HOOK_ENV", "SETUP_HOOK", "runtime_env", "worker_setup", "ray_init"]

RAY_JOB_CONFIG_ENV = settings.RAY_JOB_CONFIG

#: Settings the streamer and Ray's downloads read in the actors. Credentials
#: are deliberately absent: workers should use their own identity.
FORWARD_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_S3_ADDRESSING_STYLE",
    "AWS_CA_BUNDLE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
    # A GCS endpoint other than Google's (an emulator, a private endpoint): google-cloud-cpp
    # (Ray's GcsFileSystem, the streamer's reader) and google-cloud-storage (vLLM's listing).
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "STORAGE_EMULATOR_HOST",
)
FORWARD_PREFIXES = ("RUNAI_STREAMER_", "RAY_RUNAI_SHIM_")
NEVER_FORWARD = ("RAY_RUNAI_SHIM_CHAINED_SETUP_HOOK",)


def _load(path: str) -> Callable[[], Any]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def worker_setup() -> None:
    """The job-level setup hook: the shim installs (as ``import ray_runai_shim`` does; importing
    this module already ran that), then the user's hook runs."""
    from .bootstrap import activate

    activate()

    chained = os.environ.get(CHAIN_ENV)
    if chained and chained != SETUP_HOOK:
        _load(chained)()


def _chain_callable(user_hook: Callable[[], Any]) -> Callable[[], Any]:
    def ray_runai_shim_then_user_hook() -> Any:
        worker_setup()
        return user_hook()

    ray_runai_shim_then_user_hook.__name__ = getattr(user_hook, "__name__", "setup_hook")
    return ray_runai_shim_then_user_hook


def _forwardable() -> dict[str, str]:
    """Endpoint/streamer settings to forward to the job; never a credential, never a URL
    carrying one (``http://KEY:SECRET@host``): those are named in one WARNING and left out."""
    from ..redact import forwardable

    wanted = {k: os.environ[k] for k in FORWARD_ENV if k in os.environ}
    for k, v in os.environ.items():
        if k.startswith(FORWARD_PREFIXES) and k not in NEVER_FORWARD:
            wanted[k] = v
    out = {k: v for k, v in wanted.items() if forwardable(k, v)}
    held_back = sorted(set(wanted) - set(out))
    if held_back:
        logger.warning("ray-runai-shim: not forwarding %s to the job's workers: the value carries a "
                       "secret (e.g. user:password@ in a URL); set it in the workers' own environment",
                       ", ".join(held_back))
    return out


def _package_dir() -> str:
    return str(Path(__file__).resolve().parents[1])  # the ray_runai_shim package


def importable_by_workers() -> bool:
    """Will a worker on this machine import us without help (installed, or on PYTHONPATH)?"""
    from importlib import metadata

    try:
        metadata.distribution("ray-runai-shim")
        return True
    except metadata.PackageNotFoundError:
        pass
    parent = str(Path(_package_dir()).parent)
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return any(os.path.realpath(p) == os.path.realpath(parent) for p in entries)


def _job_level_env() -> dict[str, Any]:
    """The runtime_env a job submission already injected (Ray merges it with ours)."""
    raw = os.environ.get(RAY_JOB_CONFIG_ENV)
    if not raw:
        return {}
    try:
        return dict(json.loads(raw).get("runtime_env") or {})
    except Exception:
        return {}


def _plan(base: Optional[dict[str, Any]], *, ship: bool) -> InitEnv:
    return plan_init_env(base, _job_level_env(), ship=ship, package_dir=_package_dir(),
                         forward=_forwardable(), chain_callable=_chain_callable)


def _say(plan: InitEnv) -> None:
    if plan.warning:
        logger.warning("%s", plan.warning)
    if plan.added or plan.forwarded:
        logger.info(
            "ray-runai-shim: job runtime_env += %s%s%s",
            ", ".join(plan.added) or "nothing",
            f"; forwarded env (names only): {', '.join(plan.forwarded)}" if plan.forwarded else "",
            f" (merged with the submitted job's runtime_env under {OVERRIDE_ENV}=1)" if plan.override else "",
        )


def runtime_env(base: Optional[dict[str, Any]] = None, *, remote: bool = False) -> dict[str, Any]:
    """*base* plus what workers need to load the shim. The user's values always win.

    ``remote=True`` ships this package with ``py_modules`` (for clusters whose
    image does not have it installed).
    """
    plan = _plan(base, ship=remote)
    _say(plan)
    return dict(plan.runtime_env or {})


def submitted_job() -> bool:
    """Is this driver a submitted job's entrypoint (Jobs API, ``ray job submit``, RayJob)?"""
    return RAY_JOB_CONFIG_ENV in os.environ


def plan_for_init(args: tuple, kwargs: dict) -> Optional[InitEnv]:
    """What the ``ray.init`` wrapper passes on; None leaves the call untouched."""
    import ray

    if ray.is_initialized() or in_ray_worker():
        return None
    address = (args[0] if args else kwargs.get("address")) or os.environ.get(settings.RAY_ADDRESS)
    if isinstance(address, str) and address.startswith("ray://"):
        logger.warning(
            "ray-runai-shim: Ray Client (%s) does not run job-level setup hooks; install "
            "ray-runai-shim on the cluster image (see docs/deploying.md)",
            address,
        )
        return None
    # A submitted job's driver runs on the cluster: what it imports, the workers can too.
    here = submitted_job() or address in (None, "", "local")
    ship = not (here and importable_by_workers())
    return _plan(kwargs.get("runtime_env"), ship=ship)


@fail_open("extending the job's runtime_env", fallback="ray.init runs with your arguments; workers will not load the shim")
def ray_init(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``ray.init`` wrapper: the job's runtime_env gains what workers need to load the shim."""
    plan = plan_for_init(args, kwargs)
    if plan is None:
        return original(*args, **kwargs)
    _say(plan)
    new = {**kwargs, "runtime_env": plan.runtime_env}
    if not plan.override or os.environ.get(OVERRIDE_ENV) == "1":
        return original(*args, **new)
    # Ray reads the (documented) override flag in this call only; restore it afterwards.
    os.environ[OVERRIDE_ENV] = "1"
    try:
        return original(*args, **new)
    finally:
        os.environ.pop(OVERRIDE_ENV, None)


def on_ray_imported(ray: ModuleType) -> None:
    """Say so when Ray was initialised before the shim: its actors will not load it."""
    if ray.is_initialized() and not in_ray_worker():
        logger.warning(
            "ray-runai-shim: Ray was initialized before ray_runai_shim was imported, so "
            "Ray Data actors will not load the shim. Import ray_runai_shim before "
            "ray.init(), or pass ray.init(runtime_env=ray_runai_shim.runtime_env())."
        )
