"""The node relay: every weight byte read from the store once per node, however many readers.

This module decides who copies, who waits, who holds and what is freed; the copy itself, and
what it guarantees about the bytes, is :mod:`.relay_copy`.

Several engines of one model on a node (Ray Data ``concurrency=N``, Serve ``num_replicas=N``)
and the tensor-parallel ranks of one engine each stream the whole checkpoint: the node reads
N x S. With the relay, the first reader on the node copies the weight objects once, with
parallel ranged GETs, into a memory-backed directory (``/dev/shm`` unless
``RAY_RUNAI_SHIM_RELAY_DIR`` names another), in a thread of its own; every reader (its own
ranks too) reads each tensor as soon as its bytes are there and verified
(:mod:`.relay_read`), and a copy already whole is read as files, with the same
``runai_streamer`` load format. Where the readers cannot follow a copy in progress, they wait
for the whole copy (``pipelined=False``).

It is on by default, so it must be safe to leave on (docs/node-relay.md has the table):

* **nothing outlives its readers**: a reader holds a shared ``flock`` on ``.<key>.use`` from
  :func:`acquire` to :func:`release`; the kernel drops it when the reader dies, however it
  dies, and forked children never inherit it (:func:`.locks.not_inherited`). Every acquire
  and release sweeps the directory: a copy nobody holds is freed unless it fits under
  ``RAY_RUNAI_SHIM_RELAY_KEEP`` (a total for the node, most recently used kept first); an
  older version of a model being acquired now is never kept; half copies of dead fetchers
  are removed. A copy whose node expects more readers than have come (Serve's replicas start
  at their own pace) is held by its last reader, in a thread, until they come or
  ``RAY_RUNAI_SHIM_RELAY_WAIT`` (120 s) passes: a late reader reads node memory;
* **never torn, never stale**: the key holds the store, the reading identity, the URI and
  every weight object's size and content identity (S3 ETag, GCS generation); the copy is
  pinned to those identities -- each object's is read again when it is opened and after its
  last range, and any change refuses the copy -- and its marker records what was checked;
* **no other account in the way**: the directory is created atomically 0700, checked with
  ``lstat`` (a symlink, another owner or a group/other bit: one WARNING, the readers stream),
  and every file is created ``O_EXCL|O_NOFOLLOW`` relative to its directory
  (:class:`.staging.Staging`);
* **a failed copy never fails a reader**: a store that stalls past the retries, a directory
  that fills up, an object that changed, a fetcher that stops making progress: one WARNING
  naming the cause, and every reader streams from the store as it would without the relay.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..log import human_bytes, logger
from ..stores.endpoint import principal
from ..tables import settings
from . import locks, memory, relay_cluster, relay_copy, relay_progress
from .fetch import (
    FsAndPath,
    Listing,
    default_fs_and_path,
    list_model,
    open_store,
    probe_identity,
    run_all,
)
from .relay_copy import CopyFailed, complete, copy_weights, label_of, live_name, read_marker
from .staging import (
    LEGACY_STAGING,
    STAGING,
    UnsafeDirectory,
    private_dir,
    staging_label,
    staging_owner_alive,
)

RELAY, RELAY_DIR, RELAY_KEEP, RELAY_WAIT = settings.RELAY, settings.RELAY_DIR, settings.RELAY_KEEP, settings.RELAY_WAIT
#: A copy that failed this recently is not tried again by the next waiter: it streams.
FAILED_S = 60.0
#: How long a sweep waits for one already running (a sweep takes milliseconds).
SWEEP_WAIT_S = 10.0


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
    """Store and reading identity, URI, and every weight object's (key, size, content identity):
    a new version of any object is a new key, and another tenant's copy is another key."""
    h = hashlib.sha256(f"{store_key}\n{listing.uri.rstrip('/')}\n".encode())
    for f in listing.weights:
        h.update(f"{f.key}\0{f.size}\0{f.identity or f.mtime_ns}\n".encode())
    flat = "".join(c if c.isalnum() or c in "-_." else "-" for c in listing.uri.partition("://")[2])
    return f"{flat.strip('-')[-60:]}-{h.hexdigest()[:16]}"


def _store_key(store: Any) -> str:
    """The store and the account that reads it (two tenants of one uid never share a copy)."""
    return f"{store.key()}|{principal()}"


@dataclass
class Relay:
    """A node-local copy of one model's weights, held for reading by this process."""

    path: Path
    key: str
    nbytes: int
    fetched: bool  # this process read (or reads) the weights from the store
    seconds: float
    _fd: Optional[int] = field(default=None, repr=False)
    #: The copy is still being made: readers start on its verified ranges (:mod:`.relay_read`).
    live: bool = False
    _thread: Optional[threading.Thread] = field(default=None, repr=False)
    #: The readers of this model the node expects (engines; each engine's ranks read its copy).
    expected: int = 1
    _linger: Optional[threading.Thread] = field(default=None, repr=False)
    _stop_waiting: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until this process's part in the copy (fetching, or standing by to resume) is over."""
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_for_late_readers(self, timeout: Optional[float] = None) -> None:
        """Until the hold :func:`release` keeps for the node's late readers is let go."""
        if self._linger is not None:
            self._linger.join(timeout)

    def stop_waiting(self) -> None:
        """Let go of the hold kept for late readers now (an exiting process does)."""
        self._stop_waiting.set()
        self.wait_for_late_readers(timeout=10)

    @property
    def uri(self) -> str:
        return str(self.path)


def _touch(path: Path) -> None:
    """Mark *path* used now (the sweep keeps the most recently used copies)."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass


# --------------------------------------------------------------------------- sweep


@dataclass
class Copy:
    """One copy in the relay directory, as the sweep and ``doctor`` see it."""

    path: Path
    nbytes: int
    held: bool
    uri: str
    last_used: float


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


def _remove_key(base: Path, name: str, use_fd: int) -> None:
    """Free copy *name* (we hold its ``.use`` lock exclusively) and its lock files."""
    shutil.rmtree(base / name, ignore_errors=True)
    for suffix in ("use", "fetch", "failed", "came"):
        try:
            os.unlink(base / f".{name}.{suffix}")
        except OSError:
            pass
    locks.close(use_fd)


def sweep(base: Path, current: Optional[tuple[str, str, str]] = None) -> list[Path]:
    """Free what no live process holds: copies beyond ``RAY_RUNAI_SHIM_RELAY_KEEP`` (least
    recently used first), older versions of *current* ``(uri, store, key)``, half copies of dead
    fetchers. Returns the copies freed. One sweep at a time: one already running is waited for
    (it is short), since it may have seen a copy still held that this caller has just let go."""
    try:
        guard = locks.flock_path(base / ".sweep", fcntl.LOCK_EX, deadline=time.monotonic() + SWEEP_WAIT_S)
    except FileNotFoundError:  # the last reader of another copy removed the empty directory: nothing to sweep
        return []
    if guard is None:
        return []
    freed: list[Path] = []
    try:
        unheld: list[tuple[float, str, int, int, Optional[dict]]] = []
        try:
            entries = list(os.scandir(base))
        except OSError:
            return []
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                if name.endswith(".live") and entry.is_dir(follow_symlinks=False):
                    _sweep_live(base, name)  # a copy in progress: kept while a reader or its fetcher lives
                elif (STAGING.match(name) or LEGACY_STAGING.match(name)) and not staging_owner_alive(name):
                    shutil.rmtree(entry.path, ignore_errors=True)  # a fetcher that died mid-copy
                elif name.endswith(".failed") and _age(entry) > FAILED_S:
                    _unlink(entry.path)
                elif name.endswith(".came"):
                    _sweep_came(base, name)
                elif (name.endswith((".use", ".fetch")) and not os.path.lexists(base / name[1:].rpartition(".")[0])
                      and not os.path.lexists(base / live_name(name[1:].rpartition(".")[0]))):
                    _unlink_if_free(base / name)  # a lock of a copy that is gone, or was never made
                continue
            if not entry.is_dir(follow_symlinks=False):
                _unlink(entry.path)  # nothing but copies belongs here
                continue
            fd = locks.flock_path(base / f".{name}.use", fcntl.LOCK_EX, deadline=time.monotonic())
            if fd is None:
                continue  # a reader holds it
            marker = read_marker(Path(entry.path))
            unheld.append((_mtime(entry), name, tree_bytes(Path(entry.path)), fd, marker))
        room = keep_bytes()
        for _used, name, size, fd, marker in sorted(unheld, reverse=True):  # most recently used first
            older = (current is not None and marker is not None and name != current[2]
                     and (marker.get("uri"), marker.get("store")) == current[:2])
            if marker is None or older or size > room:
                _remove_key(base, name, fd)
                freed.append(base / name)
            else:
                room -= size
                locks.close(fd)
    finally:
        locks.close(guard)
    return freed


def _sweep_came(base: Path, name: str) -> None:
    """Remove the reader count *name* of a copy that is gone, once no reader holds its key (a
    reader counts itself before its copy is begun)."""
    key = name[1:-len(".came")]
    if os.path.lexists(base / key) or os.path.lexists(base / live_name(key)):
        return
    if os.path.lexists(base / f".{key}.use"):
        use = locks.flock_path(base / f".{key}.use", fcntl.LOCK_EX, deadline=time.monotonic())
        if use is None:
            return  # a reader holds the key
        locks.close(use)
    _unlink(str(base / name))


def _sweep_live(base: Path, name: str) -> None:
    """Remove the copy in progress *name* when no reader holds its key and no fetcher copies it
    (a killed fetcher's copy is resumed only by a reader that still holds the key)."""
    key = name[1:-len(".live")]
    use = locks.flock_path(base / f".{key}.use", fcntl.LOCK_EX, deadline=time.monotonic())
    if use is None:
        return
    try:
        fetch = locks.flock_path(base / f".{key}.fetch", fcntl.LOCK_EX, deadline=time.monotonic())
        if fetch is None:
            return
        try:
            shutil.rmtree(base / name, ignore_errors=True)
        finally:
            locks.close(fetch)
    finally:
        locks.close(use)


def _age(entry: os.DirEntry) -> float:
    return time.time() - _mtime(entry)


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def copies(base: Optional[Path] = None) -> list[Copy]:
    """The copies in this user's relay directory on this node, held or not (for ``doctor``)."""
    base = base or root()
    out: list[Copy] = []
    try:
        entries = [e for e in os.scandir(base) if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    for entry in entries:
        fd = locks.flock_path(base / f".{entry.name}.use", fcntl.LOCK_EX, deadline=time.monotonic())
        if fd is not None:
            locks.close(fd)
        marker = read_marker(Path(entry.path)) or {}
        out.append(Copy(Path(entry.path), tree_bytes(Path(entry.path)), fd is None, str(marker.get("uri", "?")),
                        _mtime(entry)))
    return out


# --------------------------------------------------------------------------- acquire / release


def _open_base() -> Optional[Path]:
    base = root()
    try:
        return private_dir(base)
    except UnsafeDirectory as e:
        reason = str(e)
    except OSError as e:
        reason = f"{base}: {e.strerror}"
    logger.warning("ray-runai-shim: the node relay cannot use its directory: %s; streaming from the store instead "
                   "(set %s to a directory of your own, or %s=off)", reason, RELAY_DIR, RELAY)
    return None


def _stream_instead(why: str) -> None:
    logger.warning("ray-runai-shim: node relay: %s; every reader streams from the store instead (its memory budget "
                   "still applies; %s=off turns the relay off)", why, RELAY)


def _wait_for_fetch(base: Path, key: str, uri: str) -> Optional[int]:
    """The key's fetch lock, waited for while the fetcher holding it makes progress; None
    after ``relay_copy.STALL_S`` without any (the caller streams)."""
    path = base / f".{key}.fetch"
    started = told = time.monotonic()
    watch = _Watch(base, key)
    while True:
        fd = locks.flock_path(path, fcntl.LOCK_EX, deadline=time.monotonic() + 0.5)
        if fd is not None:
            return fd
        still = watch.still()
        if still >= relay_copy.STALL_S:
            return None
        now = time.monotonic()
        if now - told >= 30:
            told = now
            logger.info("ray-runai-shim: node relay: waiting %.0f s for another process on this node copying %s "
                        "(its last write %.0f s ago)", now - started, uri, still)


class _Watch:
    """When the copy of a key in progress last wrote anything (its files' mtimes move with every
    write): a waiter waits while it moves, not on a fixed clock."""

    def __init__(self, base: Path, key: str) -> None:
        self.base, self.key = base, key
        self.seen, self.moved = -1.0, time.monotonic()

    def still(self) -> float:
        """Seconds since the copy last moved."""
        seen, now = _staging_activity(self.base, self.key), time.monotonic()
        if seen > self.seen:
            self.seen, self.moved = seen, now
        return now - self.moved


def _copy_dirs(base: Path, key: str) -> list[Path]:
    """Where a copy of *key* is being made: its live directory (and a staging dir of an older layout)."""
    label = label_of(key)
    try:
        return [Path(e.path) for e in os.scandir(base)
                if e.name == live_name(key) or staging_label(e.name) == label]
    except OSError:
        return []


def _staging_activity(base: Path, key: str) -> float:
    """The latest write into the copy of *key* in progress (file mtimes move with every write)."""
    latest = 0.0
    for d in _copy_dirs(base, key):
        for dirpath, _dirs, files in os.walk(d):
            for name in files:
                try:
                    latest = max(latest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except OSError:
                    pass
    return latest


def _failed_recently(base: Path, key: str) -> Optional[str]:
    try:
        st = os.lstat(base / f".{key}.failed")
        if time.time() - st.st_mtime > FAILED_S:
            return None
        return (base / f".{key}.failed").read_text()[:500]
    except OSError:
        return None


def _note_failure(base: Path, key: str, why: str) -> None:
    try:
        fd = os.open(base / f".{key}.failed", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(why)
    except OSError:
        pass


def acquire(uri: str, fs_and_path: FsAndPath = default_fs_and_path, listing: Optional[Listing] = None,
            pipelined: bool = False, readers: int = 1) -> Optional[Relay]:
    """A node-local copy of *uri*'s weights, held for reading until :func:`release`.

    The first caller on the node copies. Without *pipelined* the others wait for the whole
    copy while it makes progress, and the copy returned is complete. With *pipelined* every
    caller returns at once with a ``live`` copy: the first copies in a thread of its own, the
    others stand by to resume the copy should that process die, and the readers start on
    each range as soon as it is on the node and verified (:mod:`.relay_read`). A crashed
    copier's lock is dropped by the kernel; the next caller resumes from its verified ranges.
    None, after one WARNING, whenever the relay cannot serve the copy (it does not fit, the
    directory is not safe, the copy failed or stalled): the caller streams from the store.
    *readers*: the readers of this model the node expects, this one included (see :func:`release`)."""
    started = time.monotonic()
    fs, prefix, store = opened = open_store(uri, fs_and_path)
    listing = listing or list_model(uri, fs_and_path, opened)
    if not listing.weights:
        return None
    base = _open_base()
    if base is None:
        return None
    if relay_copy.PIN_VERSIONS:  # one HEAD per weight object: its version is part of the key
        for f, ident in zip(listing.weights, run_all(probe_identity, listing.weights, fs, prefix, uri, store)):
            f.identity = ident
    store_key = _store_key(store)
    key = key_for(listing, store_key)
    final = base / key
    nbytes = listing.weight_bytes
    use_fd = _hold(base, key)
    if use_fd is None:
        return None
    _came(base, key)  # counted whether it relays or streams: a reader that came is not waited for
    try:
        sweep(base, current=(listing.uri, store_key, key))
        fetched = False
        if not complete(final, listing):
            room = memory.room(base)
            if nbytes > room.usable():
                logger.warning(
                    "ray-runai-shim: the node relay cannot hold %s (%s) in %s (%s); streaming from the store "
                    "instead (set %s to a larger directory, or %s=off)", listing.uri, human_bytes(nbytes), base,
                    room.describe(), RELAY_DIR, RELAY)
                return _give_up(use_fd, base)
            if pipelined:
                relay = _start_or_join(base, key, listing, opened, store_key, final, use_fd, started)
                if relay is None:
                    return _give_up(use_fd, base)
                relay.expected = max(1, readers)
                return relay
            fetch_fd = _wait_for_fetch(base, key, listing.uri)
            if fetch_fd is None:
                _stream_instead(f"the copy of {listing.uri} made no progress for {relay_copy.STALL_S:.0f} s")
                return _give_up(use_fd, base)
            why = None
            try:
                if not complete(final, listing):
                    sweep(base, current=(listing.uri, store_key, key))  # what a fetcher that died left
                    failed = _failed_recently(base, key)
                    if failed is not None:
                        why = f"the copy of {listing.uri} failed moments ago ({failed})"
                    else:
                        shutil.rmtree(final, ignore_errors=True)  # a broken copy under this key
                        try:
                            copy_weights(listing, fs, prefix, store, store_key, base, key, final,
                                         share=lambda: _share(base, key, listing))
                            fetched = True
                        except CopyFailed as e:
                            _note_failure(base, key, str(e))
                            why = str(e)
            finally:
                _unlock_fetch(base, key, fetch_fd)  # before the sweep below: what the copy left goes with it
            if why is not None:
                _stream_instead(why)
                return _give_up(use_fd, base)
        _touch(final)
        relay = Relay(final, key, nbytes, fetched, time.monotonic() - started, use_fd, expected=max(1, readers))
    except BaseException:
        _give_up(use_fd, base)
        raise
    logger.info("ray-runai-shim: node relay: %s %s of weights %s %s in %.2f s", "fetched" if fetched else "reused",
                human_bytes(nbytes), "from" if fetched else "already read from", listing.uri, relay.seconds)
    return relay


def _start_or_join(base: Path, key: str, listing: Listing, opened: tuple, store_key: str, final: Path,
                   use_fd: int, started: float) -> Optional[Relay]:
    """The pipelined relay: start the copy in a thread, or join the one another process makes
    (standing by to resume it). None when the copy failed moments ago or nothing moves."""
    watch = _Watch(base, key)
    while True:
        if complete(final, listing):
            return Relay(final, key, listing.weight_bytes, False, time.monotonic() - started, use_fd)
        fetch_fd = locks.flock_path(base / f".{key}.fetch", fcntl.LOCK_EX, deadline=time.monotonic())
        if fetch_fd is not None:
            if complete(final, listing):
                _unlock_fetch(base, key, fetch_fd)
                continue
            failed = _failed_recently(base, key)
            if failed is not None:
                _unlock_fetch(base, key, fetch_fd)
                _stream_instead(f"the copy of {listing.uri} failed moments ago ({failed})")
                return None
            sweep(base, current=(listing.uri, store_key, key))  # keeps the copy in progress: we hold its key
            shutil.rmtree(final, ignore_errors=True)  # a broken copy under this key
            relay = Relay(final, key, listing.weight_bytes, True, time.monotonic() - started, use_fd, live=True)
            _run(relay, _fetch, relay, base, key, listing, opened, store_key, fetch_fd)
            logger.info("ray-runai-shim: node relay: copying %s of weights from %s into %s; readers on this node "
                        "start on each range as it lands", human_bytes(listing.weight_bytes), listing.uri, final)
            return relay
        record = relay_progress.read_record_at(base / live_name(key))
        if record is not None and record.get("state") == relay_progress.FAILED:
            _stream_instead(f"the copy of {listing.uri} failed ({str(record.get('why'))[:300]})")
            return None
        if record is not None:
            relay = Relay(final, key, listing.weight_bytes, False, time.monotonic() - started, use_fd, live=True)
            _run(relay, _stand_by, relay, base, key, listing, opened, store_key)
            logger.info("ray-runai-shim: node relay: another process on this node copies %s; reading each range "
                        "as it lands", listing.uri)
            return relay
        if watch.still() >= relay_copy.STALL_S:
            _stream_instead(f"the copy of {listing.uri} made no progress for {relay_copy.STALL_S:.0f} s")
            return None
        time.sleep(0.05)


def _run(relay: Relay, target: Any, *args: Any) -> None:
    relay._thread = threading.Thread(target=target, args=args, name="rrs-relay-copy", daemon=True)
    relay._thread.start()


def _unlock_fetch(base: Path, key: str, fetch_fd: int) -> None:
    locks.close(fetch_fd)
    _unlink_if_free(base / f".{key}.fetch")


def _fetch(relay: Relay, base: Path, key: str, listing: Listing, opened: tuple, store_key: str, fetch_fd: int) -> None:
    """Make (or resume) the copy, holding the key's fetch lock; the readers follow its record."""
    fs, prefix, store = opened
    t0 = time.monotonic()
    try:
        copied = copy_weights(listing, fs, prefix, store, store_key, base, key, relay.path,
                              share=lambda: _share(base, key, listing))
        logger.info("ray-runai-shim: node relay: copied %s of weights of %s in %.2f s (%s of it from the store)",
                    human_bytes(listing.weight_bytes), listing.uri, time.monotonic() - t0, human_bytes(copied))
    except CopyFailed as e:
        _note_failure(base, key, str(e))
        _stream_instead(str(e))
    except Exception:
        _note_failure(base, key, "the copy stopped on a shim bug")
        logger.warning("ray-runai-shim: node relay: the copy of %s stopped (a shim bug; please report it); the "
                       "readers stream from the store", listing.uri, exc_info=True)
    finally:
        _unlock_fetch(base, key, fetch_fd)
        if relay._fd is None:  # every reader here loaded before the copy ended: free it if no one holds it
            sweep(base)
            _tidy(base)


def _share(base: Path, key: str, listing: Listing) -> Optional[Any]:
    """This node's part in the cluster's one store read (:mod:`.relay_cluster`), if any."""
    def room() -> int:  # the node's memory beyond the copy itself: the source's objects take as much again
        try:
            return memory.room(base).usable()
        except OSError:
            return 0

    return relay_cluster.join(key, listing.uri, listing.weight_bytes, room)


def _stand_by(relay: Relay, base: Path, key: str, listing: Listing, opened: tuple, store_key: str) -> None:
    """While this process holds the copy: should its fetcher die, resume the copy here."""
    while relay._fd is not None:
        fetch_fd = locks.flock_path(base / f".{key}.fetch", fcntl.LOCK_EX, deadline=time.monotonic() + 1.0)
        if fetch_fd is None:
            continue
        record = relay_progress.read_record_at(base / live_name(key))
        if complete(relay.path, listing) or record is None or record.get("state") != relay_progress.COPYING:
            _unlock_fetch(base, key, fetch_fd)
            return
        logger.warning("ray-runai-shim: node relay: the process copying %s is gone; resuming its copy here",
                       listing.uri)
        _fetch(relay, base, key, listing, opened, store_key, fetch_fd)
        return


def _hold(base: Path, key: str) -> Optional[int]:
    """A shared lock on the key's ``.use`` file: a reader from here on, no one frees the copy.
    The directory may be removed by the last reader of another copy between our check and
    the lock (it removes it only when empty): made again then."""
    for attempt in range(5):
        try:
            return locks.flock_path(base / f".{key}.use", fcntl.LOCK_SH)
        except FileNotFoundError:
            if attempt == 4:
                raise
            if _open_base() is None:
                return None
    return None


def _give_up(use_fd: int, base: Path) -> None:
    locks.close(use_fd)
    sweep(base)
    _tidy(base)
    return None


def _tidy(base: Path) -> None:
    """Remove the directory itself when nothing of the shim's is left in it."""
    _unlink_if_free(base / ".sweep")
    try:
        base.rmdir()
    except OSError:
        pass


def _unlink_if_free(path: Path) -> None:
    try:
        fd = locks.flock_path(path, fcntl.LOCK_EX, deadline=time.monotonic())
    except FileNotFoundError:  # its directory is gone: another reader let go last and tidied it away
        return
    if fd is not None:
        try:
            path.unlink(missing_ok=True)
        finally:
            locks.close(fd)


def _came(base: Path, key: str) -> None:
    """Count one more reader of *key* on this node: a byte appended to ``.<key>.came`` (freed
    with the copy, so a copy made again counts afresh)."""
    try:
        fd = os.open(base / f".{key}.came", os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:  # not counted: the copy waits for one reader too many, within RAY_RUNAI_SHIM_RELAY_WAIT
        return
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)


def came(base: Path, key: str) -> int:
    """How many readers of *key* this node has had since its copy was begun."""
    try:
        return os.stat(base / f".{key}.came", follow_symlinks=False).st_size
    except OSError:
        return 0


_release_guard = threading.Lock()


def release(relay: Relay) -> bool:
    """This process has loaded its weights: drop its hold; the last reader frees the copy
    (unless ``RAY_RUNAI_SHIM_RELAY_KEEP`` keeps it). Idempotent. True when this call freed it.

    While fewer readers have come than the node expects (``relay.expected``: Serve's replicas
    that start later than this one loaded), the hold is kept in a thread
    until they have come or ``RAY_RUNAI_SHIM_RELAY_WAIT`` has passed (False now; the thread
    lets go then): a late reader reads node memory, not the store again."""
    with _release_guard:
        if relay._fd is None or relay._linger is not None:
            return False
        had = came(relay.path.parent, relay.key) if relay.expected > 1 else relay.expected
        if had < relay.expected:
            relay._linger = threading.Thread(target=_linger, args=(relay, had), name="rrs-relay-wait", daemon=True)
            relay._linger.start()
            return False
    return _let_go(relay)


def _linger(relay: Relay, had: int) -> None:
    wait_s = relay_cluster.linger_s()  # one wait for late readers, on the node and across nodes
    logger.info("ray-runai-shim: node relay: %d of the %d readers this node expects have come; keeping %s for "
                "the others for up to %.0f s (%s)", had, relay.expected, relay.path, wait_s, RELAY_WAIT)
    deadline = time.monotonic() + wait_s
    while came(relay.path.parent, relay.key) < relay.expected and time.monotonic() < deadline:
        if relay._stop_waiting.wait(0.2):
            break
    try:
        _let_go(relay)
    except Exception:
        logger.warning("ray-runai-shim: node relay: could not let go of %s", relay.path, exc_info=True)


def _let_go(relay: Relay) -> bool:
    with _release_guard:
        fd, relay._fd = relay._fd, None
    if fd is None:
        return False
    locks.close(fd)  # drops the shared lock
    base = relay.path.parent
    freed = relay.path in sweep(base)
    if freed:
        logger.info("ray-runai-shim: node relay: the last reader has loaded; freed %s (%s)", relay.path,
                    human_bytes(relay.nbytes))
    _tidy(base)
    return freed
