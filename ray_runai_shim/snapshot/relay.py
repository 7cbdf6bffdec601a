"""The node relay: every weight byte read from the store once per node, however many readers.

Several engines of one model on a node (Ray Data ``concurrency=N``, Serve ``num_replicas=N``)
and the tensor-parallel ranks of one engine each stream the whole checkpoint: the node reads
N x S. With the relay, the first reader on the node fetches the weight objects once, with
parallel ranged GETs, into a memory-backed directory (``/dev/shm`` unless
``RAY_RUNAI_SHIM_RELAY_DIR`` names another); the others wait on the same lock; then every
reader streams the local files with the same ``runai_streamer`` load format.

The rules that keep it honest (the same ones as the non-weight cache):

* keyed by store, endpoint, URI and every weight object's size and mtime: never stale,
  never shared across stores; the directory is private to this user (0700);
* a copy is served only once complete: staging directory, sizes checked, a completion
  marker, one ``rename``; a half file is never visible;
* one exclusive ``flock`` per key for the fetch: a fetcher that crashes or is killed drops
  it, and the next reader takes over (stale staging directories are removed);
* a reader holds a shared ``flock`` from :func:`acquire` to :func:`release`; the last one
  out (the exclusive lock taken without waiting) frees the copy, unless it fits under
  ``RAY_RUNAI_SHIM_RELAY_KEEP`` (bytes kept for restarts);
* when the copy does not fit the node's memory (:mod:`.memory`), :func:`acquire` returns
  None after one log line and the caller streams from the store as before -- never Ray's
  full copy, never an OOM.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..diagnostics.redact import redact_text
from ..errors import ShimError
from ..log import human_bytes, logger
from ..tables import settings
from . import memory
from .fetch import FsAndPath, Listing, _open_store, default_fs_and_path, list_model
from .locks import same_file

RELAY, RELAY_DIR, RELAY_KEEP = settings.RELAY, settings.RELAY_DIR, settings.RELAY_KEEP
MARKER = ".ray-runai-shim-relay.json"
RANGE_BYTES = 32 << 20
WORKERS = 8
DEFAULT_WAIT_S = 3600.0
#: Tries per range. pyarrow's S3 client gives up on a reply that sends nothing for 3 s
#: (the AWS SDK's request timeout); a congested link or a starved store does that now and
#: then, and one stalled range must not cost the node its copy (every reader would then
#: stream from the store). Measured: tests/snapshot/test_relay.py's stalled range.
RANGE_TRIES = 4
RETRY_PAUSE_S = 0.5

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def mode() -> str:
    """``auto`` (relay where two or more readers share the node), ``on`` or ``off``."""
    return settings.choice(RELAY, ("auto", "on", "off"), "auto")


def root() -> Path:
    """Where copies live: ``RAY_RUNAI_SHIM_RELAY_DIR`` or a per-user directory in ``/dev/shm``."""
    named = settings.path(RELAY_DIR)
    base = named if named is not None else Path("/dev/shm")
    return base / f"ray-runai-shim-relay-{os.getuid()}"


def keep_bytes() -> int:
    return settings.count(RELAY_KEEP, 0)


def key_for(listing: Listing, store_key: str) -> str:
    """Store, endpoint, URI and every weight object's (key, size, mtime): a new version of
    any object is a new key."""
    h = hashlib.sha256(f"{store_key}\n{listing.uri.rstrip('/')}\n".encode())
    for f in listing.weights:
        h.update(f"{f.key}\0{f.size}\0{f.mtime_ns}\n".encode())
    flat = "".join(c if c.isalnum() or c in "-_." else "-" for c in listing.uri.partition("://")[2])
    return f"{flat.strip('-')[-60:]}-{h.hexdigest()[:16]}"


@dataclass
class Relay:
    """A node-local copy of one model's weights, held for reading by this process."""

    path: Path
    key: str
    nbytes: int
    fetched: bool  # this process read the weights from the store
    seconds: float
    _fd: Optional[int] = field(default=None, repr=False)

    @property
    def uri(self) -> str:
        return str(self.path)


def _open(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o600)


def _lock(path: Path, how: int, deadline: Optional[float] = None) -> Optional[int]:
    """flock *path* (re-opened if the file was unlinked and re-created meanwhile); None when
    the lock is not had by *deadline* (or at once, with ``LOCK_NB``)."""
    while True:
        fd = _open(path)
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
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            return fd
        os.close(fd)  # the last reader removed it meanwhile: lock the new one


def _complete(path: Path, nbytes: int) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("bytes") == nbytes


def _read_range(src: Any, off: int, length: int, uri: str) -> bytes:
    """*length* bytes at *off*, read again after a failed try (``RANGE_TRIES`` in all)."""
    for attempt in range(1, RANGE_TRIES):
        try:
            return src.read_at(length, off)
        except OSError as e:
            logger.warning("ray-runai-shim: node relay: reading %s bytes at %s from %s failed (%s); try %d of %d",
                           length, off, uri, redact_text(str(e).splitlines()[0][:200]), attempt + 1, RANGE_TRIES)
            time.sleep(RETRY_PAUSE_S * attempt)
    return src.read_at(length, off)  # the last try: its error is the copy's


def _fetch_into(listing: Listing, fs: Any, prefix: str, staging: Path) -> int:
    """Every weight object of *listing* into *staging*, in ranges read in parallel."""
    jobs: list[tuple[Any, int, int, int]] = []  # (file handle, fd, offset, length)
    handles: list[tuple[Any, int]] = []
    try:
        for f in listing.weights:
            dst = staging / f.key
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
            src = fs.open_input_file(f"{prefix}/{f.key}")  # random access: no decompression, ranged GETs
            handles.append((src, fd))
            if src.size() != f.size:
                raise ShimError(f"ray-runai-shim: {listing.uri}/{f.key} changed while it was being read "
                                f"(listed {f.size} bytes, now {src.size()}); run again")
            os.ftruncate(fd, f.size)
            jobs.extend((src, fd, off, min(RANGE_BYTES, f.size - off)) for off in range(0, f.size, RANGE_BYTES))

        def copy(job: tuple[Any, int, int, int]) -> int:
            src, fd, off, length = job
            data = _read_range(src, off, length, listing.uri)
            if len(data) != length:
                raise ShimError(f"ray-runai-shim: short read from {listing.uri} ({len(data)} of {length} "
                                f"bytes at offset {off}); the object changed or the store cut the reply")
            view = memoryview(data)
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done:], off + done)
            return length

        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rrs-relay") as pool:
            return sum(pool.map(copy, jobs))
    finally:
        for src, fd in handles:
            os.close(fd)
            src.close()


def _clean_stale(base: Path, key: str) -> None:
    """Staging directories of this key left by a fetcher that died (we hold its fetch lock)."""
    for p in base.glob(f".{key}.staging-*"):
        shutil.rmtree(p, ignore_errors=True)


def acquire(uri: str, fs_and_path: FsAndPath = default_fs_and_path, listing: Optional[Listing] = None,
            wait_s: float = DEFAULT_WAIT_S) -> Optional[Relay]:
    """A complete node-local copy of *uri*'s weights, held for reading until :func:`release`.

    The first caller on the node fetches; the others wait for it (a crashed fetcher's lock
    is dropped by the kernel and the next caller takes over). None, after one log line,
    when the copy does not fit this node's memory: the caller streams from the store.
    """
    started = time.monotonic()
    fs, prefix, store = _open_store(uri, fs_and_path)
    listing = listing or list_model(uri, fs_and_path)
    nbytes = listing.weight_bytes
    if not listing.weights:
        return None
    base = root()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base.stat().st_uid != os.getuid():
        raise ShimError(f"ray-runai-shim: the relay directory {base} belongs to another user; "
                        f"set {RELAY_DIR} to a directory of your own")
    key = key_for(listing, store.key())
    final = base / key
    use_fd = _lock(base / f".{key}.use", fcntl.LOCK_SH)  # a reader from here on: no one frees it
    assert use_fd is not None  # a blocking lock always comes back with the fd
    held = True
    try:
        fetched = False
        if not _complete(final, nbytes):
            room = memory.room(base)
            if nbytes > room.usable():
                logger.warning(
                    "ray-runai-shim: the node relay cannot hold %s (%s) in %s (%s); streaming from the store "
                    "instead (set %s to a larger directory, or %s=off)", listing.uri, human_bytes(nbytes), base,
                    room.describe(), RELAY_DIR, RELAY)
                held = False
                _unlock_use(use_fd, final, key, base)
                return None
            fetch_fd = _lock(base / f".{key}.fetch", fcntl.LOCK_EX, deadline=time.monotonic() + wait_s)
            if fetch_fd is None:
                raise ShimError(f"ray-runai-shim: waited {wait_s:.0f} s for another process on this node to "
                                f"fetch {listing.uri} into {base}; it holds the lock still")
            try:
                if not _complete(final, nbytes):
                    _clean_stale(base, key)
                    shutil.rmtree(final, ignore_errors=True)
                    staging = base / f".{key}.staging-{os.getpid()}-{os.urandom(4).hex()}"
                    staging.mkdir(mode=0o700)
                    try:
                        got = _fetch_into(listing, fs, prefix, staging)
                        (staging / MARKER).write_text(json.dumps(
                            {"uri": listing.uri, "store": store.key(), "bytes": got,
                             "files": {f.key: f.size for f in listing.weights}}))
                        os.rename(staging, final)
                    except BaseException:
                        shutil.rmtree(staging, ignore_errors=True)
                        raise
                    fetched = True
            finally:
                os.close(fetch_fd)
                _unlink_if_free(base / f".{key}.fetch")
        relay = Relay(final, key, nbytes, fetched, time.monotonic() - started, use_fd)
    except BaseException:
        if held:
            _unlock_use(use_fd, final, key, base)
        raise
    logger.info("ray-runai-shim: node relay: %s %s of weights %s %s in %.2f s", "fetched" if fetched else "reused",
                human_bytes(nbytes), "from" if fetched else "already read from", listing.uri, relay.seconds)
    return relay


def _unlink_if_free(path: Path) -> None:
    fd = _lock(path, fcntl.LOCK_EX, deadline=time.monotonic())
    if fd is not None:
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _unlock_use(use_fd: int, final: Path, key: str, base: Path) -> bool:
    """Stop reading; the last reader out frees the copy (unless kept). True if freed."""
    use_path = base / f".{key}.use"
    os.close(use_fd)  # drops the shared lock
    fd = _lock(use_path, fcntl.LOCK_EX, deadline=time.monotonic())
    if fd is None:
        return False  # another reader still loads
    try:
        size = tree_bytes(final)
        if size and size <= keep_bytes():
            return False
        shutil.rmtree(final, ignore_errors=True)
        use_path.unlink(missing_ok=True)
        try:
            base.rmdir()  # only when nothing else of the shim's is left in it
        except OSError:
            pass
        return size > 0
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under *path* (0 when it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


_release_guard = threading.Lock()


def release(relay: Relay) -> bool:
    """This process has loaded its weights: drop its hold; the last reader frees the copy.
    Idempotent. True when this call freed the copy."""
    with _release_guard:
        fd, relay._fd = relay._fd, None
    if fd is None:
        return False
    freed = _unlock_use(fd, relay.path, relay.key, relay.path.parent)
    if freed:
        logger.info("ray-runai-shim: node relay: the last reader has loaded; freed %s (%s)", relay.path,
                    human_bytes(relay.nbytes))
    return freed
