"""Stdlib-only first stage: wait for ``import ray`` before loading anything heavy.

``import ray_runai_shim`` runs in drivers, every Ray worker, and (through a
sitecustomize or ``.pth``) possibly every interpreter on an image. Importing
wrapt costs ~40 ms (it pulls in asyncio), so until Ray itself is imported the
shim only leaves this tiny meta-path watcher. When Ray is imported, the
installer (:mod:`.patches`) registers wrapt post-import hooks on Ray's
consumer modules, which are imported much later (by ``ray.data.llm``), so no
hook is missed.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Optional

from ..tables import settings

DISABLE_ENV = settings.DISABLE


def disabled_by_env() -> bool:
    return settings.disabled()


def waiting_for_ray() -> bool:
    """Activated, enabled, and Ray not imported yet (the hooks go in on ``import ray``)."""
    return _wanted and "ray" not in sys.modules and not disabled_by_env()


def _full_install() -> bool:
    try:
        from .. import patches

        return patches.install()
    except Exception as e:  # never break the importer (e.g. wrapt missing on a worker)
        import logging

        logging.getLogger("ray.runai_shim").warning("ray-runai-shim is inactive: %r", e)
        return False


class _RayWatcher:
    """A meta-path finder that only watches for the top-level ``ray`` package."""

    busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if fullname != "ray" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec("ray")
        finally:
            self.busy = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        remove_watcher()
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            if not disabled_by_env() and _wanted:
                _full_install()

        loader.exec_module = exec_module
        return spec


_watcher: Optional[_RayWatcher] = None
_wanted = False


def remove_watcher() -> None:
    global _watcher
    if _watcher is not None and _watcher in sys.meta_path:
        sys.meta_path.remove(_watcher)
    _watcher = None


def activate(now: bool = False) -> bool:
    """Install now if Ray is imported (or *now*: a process that will never import Ray, whose
    Ray-free patches must be in place when vLLM is imported), else on Ray's import. False if
    disabled."""
    global _watcher, _wanted
    if disabled_by_env():
        return False
    _wanted = True
    if now or "ray" in sys.modules:
        return _full_install()
    if _watcher is None:
        _watcher = _RayWatcher()
        sys.meta_path.insert(0, _watcher)
    return True


def deactivate() -> None:
    global _wanted
    _wanted = False
    remove_watcher()
    patches = sys.modules.get("ray_runai_shim.patches")
    if patches is not None:
        patches.uninstall()
