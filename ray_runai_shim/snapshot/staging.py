"""Staging directories: where a version is assembled before it is renamed into place.

A staging directory is private (0700) and named after its owner's boot id, pid
and start time, so a later run can tell a process that died mid-fetch
(``kill -9``, OOM, reboot) from a live one and remove what it left. Every
directory inside is opened with ``O_NOFOLLOW`` relative to its parent's fd and
every file created with ``O_CREAT|O_EXCL|O_NOFOLLOW``: nothing is written
through a symlink, wherever one was planted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Optional

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:
        return "nb"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "0"
    return text.rpartition(")")[2].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_token() -> str:
    """This process as ``<boot id>-<pid>-<start time>``: unique across pid reuse and reboots."""
    pid = os.getpid()
    return f"{_boot_id()}-{pid}-{_start_time(pid) or '0'}"


#: Names of staging dirs (this layout) and of what the previous layout left after a crash.
STAGING = re.compile(
    r"^\.staging-(?P<boot>[0-9a-f]{8}|nb)-(?P<pid>\d+)-(?P<start>\d+)-(?:(?P<label>[0-9a-f]{16})-)?[0-9a-f]{8}$")
LEGACY_STAGING = re.compile(r"^\..+\.staging-(?P<pid>\d+)-[0-9a-f]{8}$")  # layout 1
LEGACY_OLD = re.compile(r"^\..+\.old-[0-9a-f]{8}$")  # layout 1, left by a crash


def staging_owner_alive(name: str) -> bool:
    """Whether the process that created staging dir *name* is still running."""
    m = STAGING.match(name)
    if m is None:
        m2 = LEGACY_STAGING.match(name)
        return _pid_alive(int(m2["pid"])) if m2 else True
    pid = int(m["pid"])
    if m["boot"] == "nb" or not Path("/proc").is_dir():
        return _pid_alive(pid)
    if m["boot"] != _boot_id():
        return False
    start = _start_time(pid)
    return start is not None and (start == m["start"] or start == "0")


def read_json(path: Path | str, limit: int, dir_fd: Optional[int] = None) -> Optional[dict]:
    """The JSON object in *path* (a manifest, a marker, a progress record; relative to *dir_fd*
    when given), read without following a symlink and at most *limit* bytes; None when it is
    absent, unreadable or not an object."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(limit))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def staging_label(name: str) -> Optional[str]:
    m = STAGING.match(name)
    return m["label"] if m else None


class UnsafeDirectory(Exception):
    """A directory that another account created, planted as a symlink, or left open to
    others: nothing of ours is written there."""


def private_dir(path: Path) -> Path:
    """*path* as a directory only this user can use, created atomically (``mkdir`` 0700) if
    missing. Never follows a symlink at *path*; raises :class:`UnsafeDirectory` (naming why)
    when it is not a directory, belongs to another user, or is open to group or others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return private_dir(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symlink (to {os.readlink(path)})")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise UnsafeDirectory(f"{path} is open to other users (mode {oct(st.st_mode & 0o777)})")
    return path


class Staging:
    """A private (0700) directory filled file by file, then renamed into place whole.

    Every directory is opened with ``O_NOFOLLOW`` relative to its parent's fd and every
    file created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, so no write lands outside it."""

    def __init__(self, base: Path, label: str = "", name: str = "") -> None:
        """*label* (16 hex digits) names what is being assembled, for those who wait on it.
        *name*: a fixed name instead of the owner's, adopted when it exists (the node relay's
        copy in progress, which the next fetcher resumes where a killed one stopped)."""
        tag = f"{label}-" if label else ""
        self.path = base / (name or f".staging-{owner_token()}-{tag}{uuid.uuid4().hex[:8]}")
        self.adopted = False
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            if not name:
                raise
            self.adopted = True  # opened below with O_NOFOLLOW: never a planted symlink
        self._dirs: dict[PurePosixPath, int] = {}
        self._guard = threading.Lock()
        self._dirs[PurePosixPath(".")] = os.open(self.path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)

    def _dir_fd(self, rel: PurePosixPath) -> int:
        with self._guard:
            if rel in self._dirs:
                return self._dirs[rel]
            parent = self._dir_fd_locked(rel.parent)
            return self._open_child(parent, rel)

    def _dir_fd_locked(self, rel: PurePosixPath) -> int:
        if rel in self._dirs:
            return self._dirs[rel]
        return self._open_child(self._dir_fd_locked(rel.parent), rel)

    def _open_child(self, parent_fd: int, rel: PurePosixPath) -> int:
        try:
            os.mkdir(rel.name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
        fd = os.open(rel.name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=parent_fd)
        self._dirs[rel] = fd
        return fd

    def create(self, rel: PurePosixPath, mode: int = 0o644, readable: bool = False) -> Any:
        """A new binary file at *rel* for writing (and reading back, *readable*), never through
        a symlink."""
        parent = self._dir_fd(rel.parent)
        access = os.O_RDWR if readable else os.O_WRONLY
        fd = os.open(rel.name, access | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=parent)
        return os.fdopen(fd, "r+b" if readable else "wb")

    @property
    def fd(self) -> int:
        """The directory's own fd (it follows the directory through :meth:`commit`'s rename)."""
        return self._dirs[PurePosixPath(".")]

    def open_existing(self, rel: PurePosixPath) -> Any:
        """An existing regular file at *rel* for reading and writing in place (resuming), never
        through a symlink; FileNotFoundError when it is not there."""
        fd = os.open(rel.name, os.O_RDWR | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=self._dir_fd(rel.parent))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileNotFoundError(f"{rel} is not a regular file")
        return os.fdopen(fd, "r+b")

    def unlink(self, rel: PurePosixPath) -> None:
        """Remove the file at *rel* (gone already is fine). Whoever has it open or mapped keeps
        reading it; its memory goes with the last of them."""
        try:
            os.unlink(rel.name, dir_fd=self._dir_fd(rel.parent))
        except FileNotFoundError:
            pass

    def write_atomic(self, rel: PurePosixPath, data: bytes) -> None:
        """*data* as *rel*, replacing it whole (a reader sees the old or the new, never half)."""
        parent = self._dir_fd(rel.parent)
        tmp = f".{rel.name}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            os.unlink(tmp, dir_fd=parent)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, rel.name, src_dir_fd=parent, dst_dir_fd=parent)

    def commit(self, vdir: Path) -> None:
        """Make the staging dir readable and rename it to *vdir* (atomic)."""
        os.fchmod(self._dirs[PurePosixPath(".")], 0o755)
        os.rename(self.path, vdir)
        self.close()

    def close(self) -> None:
        with self._guard:
            for fd in self._dirs.values():
                os.close(fd)
            self._dirs.clear()

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
