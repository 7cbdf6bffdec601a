"""Serve apps deployed from a config file (``serve deploy``/``serve run config.yaml``, RayService).

There the app's module is imported by the Serve controller's build task (a Ray worker),
not by a driver, and the replicas are the controller's actors: no job-level setup hook
ever reaches them, and the replica never imports the user's module (Serve LLM's
deployment classes live in ``ray.llm``). When the app's module imports the shim, the
build task has it; this wrapper gives every deployment the task builds
``RAY_RUNAI_SHIM_AUTOLOAD=1``, so each replica loads the shim at interpreter start
through the wheel's ``.pth``. Where that cannot work (the package is not installed as
a wheel on this node: the ``.pth`` is missing), one WARNING in the app's build log
says what to install.
"""

from __future__ import annotations

import copy
import os
import site
import sys
from typing import Any, Callable

from ..failopen import fail_open
from ..log import logger
from .jobenv import AUTOLOAD_ENV

PTH = "ray_runai_shim_autoload.pth"


def autoload_installed() -> bool:
    """Is the wheel's autoload ``.pth`` in a site directory of this interpreter?"""
    dirs = [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages(),
            *[p for p in sys.path if p.endswith("site-packages")]]
    return any(os.path.exists(os.path.join(d, PTH)) for d in dict.fromkeys(dirs))


def with_autoload(ray_actor_options: Any) -> dict[str, Any]:
    """*ray_actor_options* whose runtime_env has ``RAY_RUNAI_SHIM_AUTOLOAD=1`` (the user's value wins)."""
    options = copy.deepcopy(dict(ray_actor_options or {}))
    env = dict(options.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault(AUTOLOAD_ENV, "1")
    env["env_vars"] = env_vars
    options["runtime_env"] = env
    return options


_said = False


def _say_once() -> None:
    """One line per build task (it builds every deployment of the app)."""
    global _said
    if _said:
        return
    _said = True
    if not autoload_installed():
        logger.warning(
            "ray-runai-shim: this Serve app is deployed from a config file, so its replicas load the shim "
            "only through the wheel's autoload, and ray-runai-shim is not installed as a package here "
            "(imported from %s). Install it in the cluster image (`pip install ray-runai-shim`) or add it "
            "to the app's runtime_env: {\"pip\": [\"ray-runai-shim\"]}; until then the replicas copy the "
            "whole model.", os.path.dirname(os.path.dirname(__file__)))
    else:
        logger.info("ray-runai-shim: the app's deployments load the shim in their replicas (%s=1)", AUTOLOAD_ENV)


@fail_open("carrying the shim into a config-deployed Serve app's replicas",
           fallback=f"replicas load the shim only with {AUTOLOAD_ENV}=1 in the app's runtime_env env_vars")
def set_default_runtime_env(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_app``'s per-deployment step; patched here, not ``build_app`` itself: the controller's
    build task is a ``ray.remote`` function, pickled by value with the names it uses, so only a
    name looked up inside ``ray.serve._private.build_app`` is seen there."""
    deployment = original(*args, **kwargs)
    from ..processes import in_ray_worker

    if not in_ray_worker():  # serve.run in a driver: the job's setup hook reaches the replicas
        return deployment
    _say_once()
    return deployment.options(ray_actor_options=with_autoload(deployment.ray_actor_options))
