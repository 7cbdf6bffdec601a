"""File locks that keep snapshots in place while they are read.

A reader takes a shared ``flock`` on ``.<version>.lock`` (beside the version
directory, so vLLM never sees it) and keeps it for the life of its process;
deleting a version needs the exclusive lock, taken non-blocking, so a version
some process still reads is never removed. Lock files may be unlinked by the
deleter, so every lock is re-checked to be on the file the path names now.
One fetch lock per (store, URI) makes concurrent actors fetch each file once.

A lock that a ``fork`` shares is not a hold: ``flock`` belongs to the open file
description, which a forked child shares, so a child that outlives its parent's
release would keep the lock (and the copy under it) alive. Locks registered with
:func:`not_inherited` are closed in every forked child; ``O_CLOEXEC`` already keeps
them from ``exec``'d (spawned) ones.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from ..log import logger
from ..tables import settings

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CacheUnusable(Exception):
    """The cache directory cannot be used (not writable, lock unavailable); the caller
    fetches into the private directory instead."""


def lock_path(vdir: Path) -> Path:
    """The lock file readers of version *vdir* hold (beside it: vLLM lists the dir itself)."""
    return vdir.parent / f".{vdir.name}.lock"


_held: dict[str, int] = {}
_held_guard = threading.Lock()


def same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def hold(vdir: Path) -> bool:
    """Take a shared lock on *vdir* for the life of this process (so no cleanup removes it
    under a reader). False when the lock file cannot be created (a read-only cache) or locked
    (ENOLCK: NFS without lockd, where nobody can take it exclusively either)."""
    path = lock_path(vdir)
    key = str(path)
    with _held_guard:
        fd = _held.get(key)
        if fd is not None and same_file(fd, path):
            return True
        if fd is not None:
            close(fd)
            del _held[key]
        try:
            _held[key] = flock_path(path, fcntl.LOCK_SH, mode=0o644)  # exclusive holders only delete, briefly
        except OSError:
            return False
        return True


_no_inherit: set[int] = set()
_no_inherit_guard = threading.Lock()


def _close_in_child() -> None:
    for fd in list(_no_inherit):
        try:
            os.close(fd)
        except OSError:
            pass
    _no_inherit.clear()


#: Tests turn this off to show what a forked child does with a shared lock otherwise.
CLOSE_IN_CHILD = True

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _close_in_child() if CLOSE_IN_CHILD else None)


def not_inherited(fd: int) -> int:
    """Close *fd* in every child this process forks from now on (until :func:`close`)."""
    with _no_inherit_guard:
        _no_inherit.add(fd)
    return fd


def close(fd: int) -> None:
    """Close a lock fd (dropping its lock) and forget it for forked children."""
    with _no_inherit_guard:
        _no_inherit.discard(fd)
    os.close(fd)


def flock_path(path: Path, how: int, deadline: Optional[float] = None, mode: int = 0o600) -> Optional[int]:
    """``flock`` *path* (``O_NOFOLLOW``, re-opened if the file was unlinked and re-created
    meanwhile) and return its fd, registered with :func:`not_inherited`. Blocks when
    *deadline* is None; else polls until then and returns None (at once for a deadline in
    the past)."""
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, mode)
        try:
            while True:
                try:
                    fcntl.flock(fd, how | (fcntl.LOCK_NB if deadline is not None else 0))
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                    if deadline is None or time.monotonic() >= deadline:
                        os.close(fd)
                        return None
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        if same_file(fd, path):
            return not_inherited(fd)
        os.close(fd)  # removed meanwhile by whoever freed it: lock the new one


def try_exclusive(path: Path) -> Optional[int]:
    """An exclusive lock on *path* if nobody holds it now (an fd for :func:`close`), else None."""
    try:
        return flock_path(path, fcntl.LOCK_EX, deadline=time.monotonic(), mode=0o644)
    except OSError:
        return None


@contextmanager
def fetch_lock(base: Path, group: str, timeout: float) -> Iterator[None]:
    """One fetcher per (store, URI) on this node; the others wait and then reuse.
    ``CacheUnusable`` when the lock cannot be had within *timeout* seconds."""
    path = base / f".{group}.fetch-lock"
    start = time.monotonic()
    deadline = start + timeout
    try:
        fd = flock_path(path, fcntl.LOCK_EX, deadline=min(deadline, start + 10), mode=0o644)
        if fd is None and deadline > start + 10:
            logger.info("ray-runai-shim: waiting for another process fetching into %s", base)
            fd = flock_path(path, fcntl.LOCK_EX, deadline=deadline, mode=0o644)
    except OSError as e:
        raise CacheUnusable(f"cannot lock {path}: {e.strerror}") from e
    if fd is None:
        raise CacheUnusable(f"{path} has been locked by another process for more than {timeout:g} s "
                            f"({settings.LOCK_TIMEOUT})")
    try:
        yield
    finally:
        close(fd)  # releases the lock
