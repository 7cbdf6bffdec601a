"""The relay copy's progress record: which byte ranges of which object are on the node, verified.

The fetcher writes it into the copy's private directory (``.progress.json``, replaced whole
by a rename: a reader sees one record or the next, never half of one); every reader that
starts on the bytes already there (:mod:`.relay_read`) and every waiter reads it. A range is
listed only once it is written *and* verified: its object's content identity read again
after the range landed is still the one the copy is pinned to (:mod:`.relay_copy`), so a
reader never reads a byte that could belong to another version. The record also lets the
next fetcher resume where a killed one stopped, and carries the figures people see: bytes
done of the total, the rate and the time left (one INFO line at most every ``LOG_EVERY_S``
on a long copy, nothing on a short one; ``status()["relay_copy"]``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from ..log import human_bytes, logger
from .staging import read_json

RECORD = ".progress.json"
LOG_EVERY_S = 10.0
COPYING, DONE, FAILED = "copying", "done", "failed"
Intervals = list[list[int]]

_figures_lock = threading.Lock()
#: The copies this process is making, by URI: what ``status()["relay_copy"]`` shows.
figures: dict[str, dict[str, Any]] = {}


def add(intervals: Intervals, start: int, end: int) -> Intervals:
    """*intervals* (sorted, disjoint ``[start, end)``) with ``[start, end)`` merged in."""
    out: Intervals = []
    placed = False
    for s, e in intervals:
        if e < start:
            out.append([s, e])
        elif end < s:
            if not placed:
                out.append([start, end])
                placed = True
            out.append([s, e])
        else:
            start, end = min(s, start), max(e, end)
    if not placed:
        out.append([start, end])
    return sorted(out)


def covers(intervals: Intervals, start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one of *intervals* (an empty range always does)."""
    if end <= start:
        return True
    return any(s <= start and end <= e for s, e in intervals)


def total(intervals: Intervals) -> int:
    return sum(e - s for s, e in intervals)


def missing(intervals: Intervals, size: int, step: int, origin: int = 0) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges of ``[0, size)`` not yet covered, cut on a grid of *step*
    bytes that starts at *origin* (a safetensors file's first tensor byte: whole tensors then
    fill whole ranges, and the first tensors land as soon as the bytes for them do)."""
    origin = origin if 0 < origin < size else 0
    cuts = sorted({0, size, origin, *range(origin, size, step)})
    spans = sorted(intervals)
    out: list[tuple[int, int]] = []
    for a, b in zip(cuts, cuts[1:]):
        pos = a
        for s, e in spans:
            if e <= pos or s >= b:
                continue
            if s > pos:
                out.append((pos, s - pos))
            pos = max(pos, e)
        if pos < b:
            out.append((pos, b - pos))
    return out


def usable(record: Optional[dict], files: list[tuple[str, int]], uri: str) -> bool:
    """A record a fetcher can resume from: the same objects and sizes, still being copied."""
    return (isinstance(record, dict) and record.get("state") == COPYING and record.get("uri") == uri
            and [tuple(f) for f in record.get("files") or []] == [tuple(f) for f in files]
            and isinstance(record.get("done"), dict))


class Publisher:
    """The fetcher's side: ranges written, then verified, then published in the record."""

    def __init__(self, staging: Any, uri: str, files: list[tuple[str, int]], done: Optional[dict] = None) -> None:
        self.staging = staging
        self.uri = uri
        self.files = files
        self.total = sum(size for _k, size in files)
        self.done: dict[str, Intervals] = {k: [list(r) for r in (done or {}).get(k, [])] for k, _s in files}
        self.resumed = sum(total(v) for v in self.done.values())
        self._written: dict[str, Intervals] = {}
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._told = self.started
        self.state, self.why = COPYING, ""

    @property
    def bytes_done(self) -> int:
        return sum(total(v) for v in self.done.values())

    def written(self, key: str, start: int, end: int) -> None:
        """A range is on the node (not yet verified). Called from the copy's threads."""
        with self._lock:
            self._written[key] = add(self._written.get(key, []), start, end)

    def take_written(self) -> dict[str, Intervals]:
        with self._lock:
            out, self._written = self._written, {}
        return out

    def verified(self, ranges: dict[str, Intervals]) -> None:
        """*ranges* were written before their object's identity was read again, unchanged."""
        for key, got in ranges.items():
            for s, e in got:
                self.done[key] = add(self.done[key], s, e)
        self.publish()
        self._tell()

    def figures(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        copied = self.bytes_done - self.resumed
        rate = copied / elapsed
        left = self.total - self.bytes_done
        return {"uri": self.uri, "state": self.state, "bytes": self.bytes_done, "total": self.total,
                "rate_bytes_s": round(rate), "eta_s": round(left / rate, 1) if rate > 0 else None,
                "elapsed_s": round(elapsed, 1), "resumed_bytes": self.resumed, "why": self.why}

    def publish(self) -> None:
        now = self.figures()
        with _figures_lock:
            figures[self.uri] = now
        record = {"v": 1, "files": [list(f) for f in self.files], "done": self.done, "updated": time.time(), **now}
        self.staging.write_atomic(PurePosixPath(RECORD), json.dumps(record).encode())

    def _tell(self) -> None:
        now = time.monotonic()
        if now - self._told < LOG_EVERY_S:
            return
        self._told = now
        f = self.figures()
        eta = f"{f['eta_s']:.0f} s" if f["eta_s"] is not None else "unknown"
        logger.info("ray-runai-shim: node relay: copying %s: %s of %s (%.0f %%), %s/s, about %s left",
                    self.uri, human_bytes(f["bytes"]), human_bytes(self.total),
                    100.0 * f["bytes"] / max(self.total, 1), human_bytes(f["rate_bytes_s"]), eta)

    def finish(self, state: str, why: str = "") -> None:
        """The copy is whole (``DONE``) or given up (``FAILED``: every reader streams instead)."""
        self.state, self.why = state, why
        try:
            self.publish()
        except OSError:  # a directory that filled up: the readers see the fetcher gone and stream
            pass


def read_record(dir_fd: int) -> Optional[dict]:
    """The record in the copy directory open as *dir_fd* (None: not written yet, or unreadable)."""
    return read_json(RECORD, 64 << 20, dir_fd=dir_fd)


def read_record_at(path: Path) -> Optional[dict]:
    """The record of the copy directory *path* (never through a symlink)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        return read_record(dir_fd)
    finally:
        os.close(dir_fd)


def current() -> list[dict[str, Any]]:
    """The copies this process made or is making, with their figures (``status()``)."""
    with _figures_lock:
        return [dict(v) for v in figures.values()]
