"""Leave ``/dev/shm`` as we found it: remove the vLLM segments our own engines left behind.

vLLM's engines create shared-memory segments (``psm_*`` message rings from Python's
``multiprocessing.shared_memory``, ``*cpushm*`` tensor-parallel buffers on CPU) and do not
always unlink them when their processes are stopped. What counts as ours: a segment of those
patterns that appeared after :func:`snapshot` was taken and that no live process has open or
mapped any more. A segment someone else still uses is never touched, and neither is anything
that was there before.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "*cpushm*")


def _ours(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in PATTERNS)


def snapshot(root: Path = SHM) -> set[str]:
    try:
        return {p.name for p in root.iterdir()}
    except OSError:
        return set()


def in_use(root: Path = SHM) -> set[str]:
    """Names under *root* that a live process has open (fd) or mapped."""
    prefix = str(root) + "/"
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        used.add(line[i + len(prefix):].split(" (deleted)")[0].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:
            continue
    return used


def clean_new(before: set[str], root: Path = SHM, wait_s: float = 0.0) -> list[str]:
    """Remove the vLLM segments that appeared since *before* and nobody uses; return them.
    With *wait_s*, segments still held are looked at again each second until then (the last
    processes of a stopped engine may still be exiting); what stays held is left alone."""
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    tried: set[str] = set()
    while True:
        new = sorted(n for n in snapshot(root) - before - tried if _ours(n))
        busy = in_use(root) if new else set()
        for name in new:
            if name in busy:
                continue
            tried.add(name)
            try:
                (root / name).unlink()
                removed.append(name)
            except OSError:
                pass
        if not any(n in busy for n in new) or time.monotonic() >= deadline:
            return removed
        time.sleep(1.0)


@contextlib.contextmanager
def tmpdir(prefix: str) -> Iterator[Path]:
    """A directory of the test's own in /dev/shm (memory-backed, like the relay's default), removed after."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=str(SHM)))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
