"""How ``./dev test`` spreads the test files over its workers (a pytest plugin).

xdist's ``--dist loadfile`` keeps each file on one worker (a file's module fixtures share one
engine run) and hands the files out in order. Two changes, from CI's measurements:

* the files that start Ray Serve are one unit: one worker runs them back to back. Side by side
  on a 2-core box a Serve proxy missed its readiness checks; a lock between workers kept them
  apart but left the waiting worker idle (up to 7 minutes of a 36-minute run);
* the longest units go first -- Serve, then files with engine tests, then the other files that
  start Ray, then the rest -- so no heavy file starts near the end while the other worker idles.
  (xdist's own reorder puts the files with the most tests first: the light parametrised ones.)
"""

from __future__ import annotations

from typing import Any

import pytest

#: Files that share one worker, back to back (the unit's name).
SHARED_UNITS = {
    "tests/integrations/test_serve.py": "serve",
    "tests/activation/test_deploy.py": "serve",
}


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


def _rank(items: list[Any]) -> int:
    if any(unit_of(i.nodeid) != i.nodeid.split("::", 1)[0] for i in items):
        return 0
    if any(i.get_closest_marker("engine") for i in items):
        return 1
    if any(i.get_closest_marker("ray") for i in items):
        return 2
    return 3


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Longest units first, each unit's tests together and in their own order.

    Only xdist's workers collect, and the controller hands out the units in their order; there
    ``option.dist`` reads "no" (xdist resets it), so the worker is known by its ``workerinput``.
    (Until 2026-12 this checked ``option.dist`` and never reordered: the files ran alphabetically.)
    """
    if not hasattr(config, "workerinput"):
        return
    units: dict[str, list[Any]] = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)
    order = sorted(units, key=lambda u: _rank(units[u]))  # stable: collection order within a rank
    items[:] = [item for u in order for item in units[u]]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without xdist
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep the order above
    return UnitScheduling(config, log)
