"""Module fixtures whose runs are made on first use: a deselected test's run costs nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any, Callable


class Runs(dict):
    """key -> ``make(key)``, made the first time a test asks for it."""

    def __init__(self, make: Callable[[Any], dict]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: Any) -> dict:
        self[key] = self._make(key)
        return self[key]


def lazy_runs(make: Callable[[Any], dict]) -> Iterator[Runs]:
    """Yield a :class:`Runs`; remove each made run's sandbox after."""
    runs = Runs(make)
    yield runs
    for run in runs.values():
        shutil.rmtree(run["sandbox"].root, ignore_errors=True)
