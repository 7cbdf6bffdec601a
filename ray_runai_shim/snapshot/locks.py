"""File locks that keep snapshots in place while they are read.

A reader takes a shared ``flock`` on ``.<version>.lock`` (beside the version
directory, so vLLM never sees it) and keeps it for the life of its process;
deleting a version needs the exclusive lock, taken non-blocking, so a version
some process still reads is never removed. Lock files may be unlinked by the
deleter, so every lock is re-checked to be on the file the path names now.
One fetch lock per (store, URI) makes concurrent actors fetch each file once.
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


def _open_lock(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
    except OSError as e:
        raise CacheUnusable(f"cannot open the lock file {path}: {e.strerror}") from e


def same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def hold(vdir: Path) -> bool:
    """Take a shared lock on *vdir* for the life of this process (so no cleanup removes it
    under a reader). False when the lock file cannot be created (a read-only cache)."""
    path = lock_path(vdir)
    key = str(path)
    with _held_guard:
        fd = _held.get(key)
        if fd is not None and same_file(fd, path):
            return True
        if fd is not None:
            os.close(fd)
            del _held[key]
        while True:
            try:
                fd = _open_lock(path)
            except CacheUnusable:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # exclusive holders only delete, briefly
            except OSError:  # ENOLCK (NFS without lockd): nobody can take it exclusively either
                os.close(fd)
                return False
            if same_file(fd, path):
                _held[key] = fd
                return True
            os.close(fd)  # the file was removed between open and lock: retry on the new one


def try_exclusive(path: Path) -> Optional[int]:
    """An exclusive lock on *path* if nobody holds it now (an fd to close), else None."""
    try:
        fd = _open_lock(path)
    except CacheUnusable:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not same_file(fd, path):
        os.close(fd)
        return None
    return fd


@contextmanager
def fetch_lock(base: Path, group: str, timeout: float) -> Iterator[None]:
    """One fetcher per (store, URI) on this node; the others wait and then reuse.
    ``CacheUnusable`` when the lock cannot be had within *timeout* seconds."""
    path = base / f".{group}.fetch-lock"
    fd = _open_lock(path)
    try:
        deadline = time.monotonic() + timeout
        delay, told = 0.02, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise CacheUnusable(f"cannot lock {path}: {e.strerror}") from e
            now = time.monotonic()
            if now >= deadline:
                raise CacheUnusable(
                    f"{path} has been locked by another process for more than {timeout:g} s "
                    f"({settings.LOCK_TIMEOUT})"
                )
            if not told and now - (deadline - timeout) > 10:
                told = True
                logger.info("ray-runai-shim: waiting for another process fetching into %s", base)
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 2, 0.5)
        yield
    finally:
        os.close(fd)  # releases the lock
