"""Wrap a name, remember the exact original, put it back: nothing else.

Used only by the installer. Names are resolved like wrapt's ``resolve_path``
(``"Class.method"`` inside a module); the original is read from the owner's
``__dict__`` so that ``uninstall()`` restores the very object that was there
(a staticmethod stays a staticmethod). A name that already holds one of our
wrappers -- ``ray.init`` is the same function as ``ray._private.worker.init``
-- is recorded as an alias and restored to the shared original.

One function is wrapped once, by its one hook, whatever number of patches need it: a
second patch on a name that already holds the same hook switches that patch's step on
(:func:`patches_on`) instead of stacking another layer; the hook calls its steps in the
order its code says (e.g. :mod:`.integrations.engine_config`).

A wrapped module function handed to ``ray.remote`` (Serve's per-node download
tasks on 2.45-2.50) is pickled by value as the original function, so the task
runs Ray's own code there (checked on 2.48 with a real task).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import wrapt

from .log import logger


@dataclass
class Applied:
    patch: str
    name: str  # "module.attr.path", as in the targets table
    owner: Any
    attr: str
    original: Any
    replacement: Any
    switch: _Switch
    hook: Any = None


class _Switch:
    """wrapt's ``enabled=``: once off, a wrapper that another module captured (``from x import
    f`` before uninstall) calls the original straight through, as if never wrapped."""

    def __init__(self) -> None:
        self.on = True

    def __call__(self) -> bool:
        return self.on


_lock = threading.Lock()
_applied: list[Applied] = []
_appended: list[tuple[str, str, list, str]] = []  # (patch, name, the list, the item)


def resolve(module: ModuleType, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, current value) of ``module.<path>``; AttributeError if absent."""
    owner: Any = module
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    value = vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)
    return owner, attr, value


def wrap(patch: str, name: str, module: ModuleType, path: str, wrapper: Callable) -> bool:
    """Wrap ``module.<path>`` with *wrapper* once per patch; False when already done. Where
    the name already holds *wrapper* (another patch's step of the same hook), *patch* is
    recorded as on for it and nothing is stacked."""
    owner, attr, current = resolve(module, path)
    with _lock:
        for a in _applied:
            if a.owner is owner and a.attr == attr and a.patch == patch:
                return False
            if a.patch == patch and current is a.replacement:  # an alias of a name we wrapped
                _applied.append(Applied(patch, name, owner, attr, a.original, a.replacement, a.switch, a.hook))
                return True
        for a in _applied:
            if current is a.replacement and a.hook is wrapper:  # one hook, one more step on
                _applied.append(Applied(patch, name, owner, attr, a.original, a.replacement, a.switch, a.hook))
                return True
        switch = _Switch()
        replacement = wrapt.FunctionWrapper(current, wrapper, enabled=switch)
        setattr(owner, attr, replacement)
        _applied.append(Applied(patch, name, owner, attr, current, replacement, switch, wrapper))
        return True


def patches_on(*names: str) -> frozenset:
    """The patches switched on for the hook of any of *names* (``"module.Class.method"``): a
    hook calls a step only where its patch is on (the version tables and feature checks of
    :mod:`.patches` decided it)."""
    with _lock:
        return frozenset(a.patch for a in _applied if a.name in names)


def append(patch: str, name: str, module: ModuleType, path: str, item: str) -> bool:
    """Append *item* to the list at ``module.<path>`` in place, so every alias sees it."""
    _owner, _attr, current = resolve(module, path)
    if not isinstance(current, list) or item in current:
        return False
    with _lock:
        current.append(item)
        _appended.append((patch, name, current, item))
    return True


def restore_all() -> None:
    """Undo everything, newest first (stacked wrappers unwind in order)."""
    with _lock:
        applied, appended = list(_applied), list(_appended)
        _applied.clear()
        _appended.clear()
    for a in reversed(applied):
        a.switch.on = False  # inert wherever it was captured
        now = vars(a.owner).get(a.attr)
        if now is a.original:
            continue  # another step of the same hook put it back already
        if now is a.replacement:
            setattr(a.owner, a.attr, a.original)
        else:
            logger.warning("ray-runai-shim: %s was re-patched by someone else; leaving it, our wrapper "
                           "stays in place and calls the original straight through", a.name)
    for _patch, _name, lst, item in reversed(appended):
        if item in lst:
            lst.remove(item)


def applied() -> list[tuple[str, str]]:
    """(patch, name) of everything in place now."""
    with _lock:
        return [(a.patch, a.name) for a in _applied] + [(p, n) for p, n, _l, _i in _appended]
