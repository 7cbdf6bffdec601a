"""The installer: install, uninstall, state -- all generated from :data:`.targets.TARGETS`.

``install()`` registers one wrapt post-import hook per consumer module in the
table. When such a module is imported, its hook applies the targets whose
patch name this Ray's version tables ask for (:mod:`.support`), after the
target's feature checks; the wrapper module named by the target is imported
only then. Hooks run outside any lock (wrapt's importer does the same), and
a hook that fails is logged and leaves Ray unpatched there -- it never breaks
``import ray``. The registry (:mod:`.registry`) restores every name exactly.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

import wrapt

from . import registry
from .log import logger
from .tables import settings, targets
from .tables.support import (
    HANDOFF,
    RAY_FREE,
    SERVE_HANDOFF,
    SERVE_MIRROR,
    SERVE_RANGES,
    SHARDED_FORMAT,
    Plan,
    parse_version,
    patches_for,
    plan_for,
)

_lock = threading.Lock()  # guards the three flags below only
_installed = False
_hooks_registered = False
_announced = False


def ray_version() -> Optional[str]:
    return getattr(sys.modules.get("ray"), "__version__", None)


def _plans(version: Optional[str] = None) -> tuple[Optional[Plan], Optional[Plan]]:
    version = version or ray_version()
    if version is None:
        return None, None
    return plan_for(version), plan_for(version, SERVE_RANGES)


#: The patches without which this table's front-end would not stream at all.
STREAMS = frozenset({HANDOFF, SERVE_HANDOFF, SERVE_MIRROR, SHARDED_FORMAT})


def _shape(plan: Plan) -> str:
    """One word or two per table for the banner: the full why is in ``status()`` and ``doctor``."""
    if not plan.known:
        return "unknown release"
    return "shim streams" if plan.patches & STREAMS else "Ray streams"


def announcement(version: Optional[str] = None) -> Optional[str]:
    """The one INFO line per job (at most 160 characters): version, Ray, what streams, where to
    see more (*version*: this process's Ray unless given). The reasons and patch names live in
    ``status()`` and ``ray-runai-shim doctor``."""
    data, serve = _plans(version)
    if data is None or serve is None:
        return None
    from .version import __version__

    count = len(patches_for(data.ray_version))
    what = f"patching {count} fixes" if count else "nothing to patch"
    return (f"ray-runai-shim {__version__}: Ray {data.ray_version}: Ray Data: {_shape(data)}; "
            f"Serve LLM: {_shape(serve)}; {what}; details: ray-runai-shim doctor")


def _announce() -> None:
    """Said once per job, by the driver (Ray's workers and daemons import the shim too: DEBUG)."""
    global _announced
    with _lock:
        if _announced:
            return
        _announced = True
    line = announcement()
    if line is None:
        return
    from .processes import in_ray_system_process, in_ray_worker

    log = logger.debug if in_ray_worker() or in_ray_system_process() else logger.info
    log("%s", line)


def _load(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _has(module: ModuleType, path: str) -> bool:
    try:
        registry.resolve(module, path)
        return True
    except (AttributeError, KeyError):
        return False


def _outside(only_for: tuple) -> Optional[str]:
    """Why a target limited to some releases of a package does not apply here (None: it does)."""
    if not only_for:
        return None
    package, low, high = only_for
    try:
        version = getattr(importlib.import_module(package), "__version__", "")
    except ImportError:
        return f"{package} is not installed"
    v = parse_version(version)
    if v is None or not (low <= v[:2] < high):
        return f"{package} {version} is outside {low[0]}.{low[1]}-{high[0]}.{high[1] - 1}"
    return None


def _apply(target: targets.Target, module: ModuleType) -> None:
    outside = _outside(target.only_for)
    if outside:
        logger.debug("ray-runai-shim: %s; not patching %s (no bug to fix there)", outside, target.name)
        return
    if target.if_has and not _has(module, target.if_has):
        logger.debug("ray-runai-shim: %s has no %s in this release; %s does not apply", module.__name__,
                     target.if_has, target.name)
        return
    if target.unless_has and _has(module, target.unless_has):
        logger.debug("ray-runai-shim: %s has %s (fixed upstream); leaving %s", module.__name__,
                     target.unless_has, target.name)
        return
    missing = [r for r in target.requires if not _has(module, r)]
    if target.kind != targets.CALL and not _has(module, target.attr):
        missing.append(target.attr)
    if missing:
        logger.warning("ray-runai-shim: Ray %s's %s has no %s; not patching %s (Ray changed shape)",
                       ray_version(), module.__name__, ", ".join(missing), target.name)
        return
    if target.kind == targets.APPEND:
        registry.append(target.patch, target.name, module, target.attr, target.value)
    elif target.kind == targets.CALL:
        _load(target.wrapper)(module)
    else:
        registry.wrap(target.patch, target.name, module, target.attr, _load(target.wrapper))


def _on_import(module: ModuleType) -> None:
    """The post-import hook of every consumer module in the table. Before Ray is imported (a
    vLLM process of its own: the engine core, a worker) only the Ray-free patches apply; when
    Ray comes, the rest are applied to what was imported before it."""
    if not _installed or settings.disabled():
        return
    version = ray_version()
    wanted = (patches_for(version) if version is not None else frozenset()) | RAY_FREE
    if module.__name__ == "ray":
        _announce()
        for name in targets.modules():
            if name != "ray" and name in sys.modules:
                _apply_all(sys.modules[name], wanted)
    _apply_all(module, wanted)


def _apply_all(module: ModuleType, wanted: frozenset) -> None:
    done = {name for _patch, name in registry.applied()}
    for target in targets.for_module(module.__name__):
        if target.patch not in wanted or (target.kind != targets.CALL and target.name in done):
            continue
        try:
            _apply(target, module)
        except Exception:  # an exception here would break the user's import
            logger.warning("ray-runai-shim: patching %s failed; Ray is left unpatched there", target.name,
                           exc_info=True)


def install() -> bool:
    """Register the hooks (idempotent). False when disabled by the environment."""
    global _installed, _hooks_registered
    if settings.disabled():
        return False
    with _lock:
        if _installed:
            return True
        _installed = True
        first = not _hooks_registered
        _hooks_registered = True
    for name in targets.modules():
        if first:
            wrapt.register_post_import_hook(_on_import, name)  # fires now if already imported
        elif name in sys.modules:
            _on_import(sys.modules[name])
    return True


def uninstall() -> None:
    """Restore every patched name exactly; the hooks stay registered but inert."""
    global _installed
    with _lock:
        _installed = False
    registry.restore_all()


def state() -> dict[str, Any]:
    """What the installer did in *this* process: the installer's half of ``status()``
    (:func:`ray_runai_shim.status` adds the rest; run it inside a Ray task to see a worker's)."""
    data, serve = _plans()
    applied = registry.applied()
    return dict(
        installed=_installed,
        pid=os.getpid(),
        ray_version=ray_version(),
        plan=sorted(data.patches) if data else [],
        why=data.why if data else "Ray is not imported in this process yet",
        serve_plan=sorted(serve.patches) if serve else [],
        serve_why=serve.why if serve else None,
        patched=sorted({name for _patch, name in applied}),
        patches_applied=sorted({patch for patch, _name in applied}),
        relay=list(getattr(sys.modules.get("ray_runai_shim.integrations.engine_relay"), "decisions", [])),
    )
