"""Stream model weights with Run:ai Model Streamer from Ray's LLM stack (Ray Data, Serve LLM).

``import ray_runai_shim`` is the whole set-up. It imports neither Ray nor
vLLM (nor wrapt) until Ray is imported; then it patches Ray's stage through
post-import hooks. ``RAY_RUNAI_SHIM_DISABLE=1`` turns it off, ``uninstall()``
restores Ray exactly, ``status()`` reports what this process patched.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .activation import bootstrap as _bootstrap
from .errors import ShimError
from .version import __version__

__all__ = ["__version__", "install", "uninstall", "status", "runtime_env", "ShimError"]


def install() -> bool:
    """Patch now (or when Ray is imported). Idempotent. False if disabled by env."""
    return _bootstrap.activate()


def uninstall() -> None:
    """Undo every patch, restoring each patched name to the exact original object."""
    _bootstrap.deactivate()


def status() -> dict[str, Any]:
    """What the shim did in this process (one shape, every key always present);
    call it inside a Ray task to see a worker's."""
    import sys

    patches = sys.modules.get(__name__ + ".patches")
    progress = sys.modules.get(__name__ + ".snapshot.relay_progress")
    copies = progress.current() if progress is not None else []
    return _status_shape(**(patches.state() if patches is not None else {}), relay_copy=copies)


def _status_shape(**fields: Any) -> dict[str, Any]:
    """``status()``'s one shape: every key always present."""
    out: dict[str, Any] = {
        "version": __version__,
        "pid": os.getpid(),
        "installed": False,
        "waiting_for_ray": _bootstrap.waiting_for_ray(),
        "disabled_by_env": _bootstrap.disabled_by_env(),
        "ray_version": None,
        "plan": [],
        "why": "Ray is not imported in this process yet",
        "serve_plan": [],
        "serve_why": None,
        "patched": [],
        "patches_applied": [],
        "relay": [],  # what the node relay decided for each engine built here
        "relay_copy": [],  # the relay copies this process makes or made: bytes done, total, rate, time left
    }
    unknown = set(fields) - set(out)
    if unknown:
        raise TypeError(f"not status keys: {sorted(unknown)}")
    out.update(fields)
    return out


def runtime_env(base: Optional[dict[str, Any]] = None, *, remote: bool = False) -> dict[str, Any]:
    """*base* plus what Ray workers need to load the shim (the user's values win)."""
    from .activation.ray_init import runtime_env as _runtime_env

    return _runtime_env(base, remote=remote)


_bootstrap.activate()
