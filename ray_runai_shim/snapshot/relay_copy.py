"""The relay's copy: every weight object read from the store once, in parallel ranged GETs,
pinned to the version it was listed at, into a staging directory renamed whole.

What the copy guarantees (:mod:`.relay` decides when to make one and who holds it):

* one version of every object: each object's content identity (S3 ETag, GCS generation) is
  part of the key; it is read again when the object is opened and after its last range, and
  any change refuses the copy (pyarrow, Ray's store client, sends no ``If-Match``: the pin
  brackets the copy);
* never half visible: space reserved first (``posix_fallocate``: a full directory fails before
  any GET), files created ``O_EXCL|O_NOFOLLOW`` in a private staging dir, a marker that records
  what was checked, one ``rename``;
* a stalled range is read again while the copy makes progress elsewhere; whatever the copy
  cannot help (the store, the directory, a changed object) is :class:`CopyFailed`, with nothing
  left behind, and the readers stream.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from ..errors import ShimError
from ..log import human_bytes, logger
from ..redact import redact_text
from ..tables import settings
from . import memory
from .fetch import Listing, identity_of, metadata_of, probe_identity, run_all
from .staging import Staging, read_json

MARKER = ".ray-runai-shim-relay.json"
RANGE_BYTES = 32 << 20
WORKERS = 8
#: A copy (or a range of it) that makes no progress for this long is given up: the fetcher
#: streams, and so does every reader waiting for it. Progress, not a fixed clock: a slow but
#: moving copy is waited for however long it takes.
STALL_S = 120.0
RETRY_PAUSE_S = 0.5
#: Tries per range while the copy still moves elsewhere. pyarrow's S3 client gives up on a
#: reply that sends nothing for 3 s (the AWS SDK's request timeout) and tries twice more; a
#: busy node or a congested link does that now and then (tests/snapshot/test_relay.py).
RANGE_TRIES = 8
#: Tests turn this off to show what a copy is without its version pin.
PIN_VERSIONS = True
RELAY_DIR = settings.RELAY_DIR


def label_of(key: str) -> str:
    """What names a copy's staging directory, for the readers that wait on it (16 hex digits)."""
    return key[-16:]


class CopyFailed(Exception):
    """The copy cannot be made (the store, the directory, a changed object); readers stream."""


def read_marker(path: Path) -> Optional[dict]:
    """The completion marker of the copy at *path* (None: not complete, or not ours)."""
    return read_json(path / MARKER, 1 << 20)


def complete(path: Path, listing: Listing) -> bool:
    """The copy at *path* is whole and of exactly the versions *listing* names."""
    marker = read_marker(path)
    if marker is None or marker.get("bytes") != listing.weight_bytes:
        return False
    files = marker.get("files") or {}
    for f in listing.weights:
        got = files.get(f.key)
        if not isinstance(got, dict) or got.get("size") != f.size or got.get("identity") != f.identity:
            return False
        try:
            if os.lstat(path / f.key).st_size != f.size:
                return False
        except OSError:
            return False
    return True


class _Progress:
    """When the copy last moved, shared by its threads: a range is retried while the copy moves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.moved = time.monotonic()

    def add(self) -> None:
        with self.lock:
            self.moved = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self.moved


def read_range(src: Any, off: int, length: int, uri: str, progress: _Progress) -> bytes:
    """*length* bytes at *off*, read again after a failed try while the copy makes progress
    (up to ``RANGE_TRIES`` tries, and never past ``STALL_S`` without progress)."""
    attempt = 1
    while True:
        try:
            return src.read_at(length, off)
        except OSError as e:
            if attempt >= RANGE_TRIES or progress.stalled_for() >= STALL_S:
                raise
            attempt += 1
            logger.warning("ray-runai-shim: node relay: reading %s bytes at %s from %s failed (%s); try %d of %d",
                           length, off, uri, redact_text(str(e).splitlines()[0][:200]), attempt, RANGE_TRIES)
            time.sleep(min(RETRY_PAUSE_S * attempt, 5.0))


def _changed(uri: str, key: str, was: Optional[str], now: Optional[str]) -> CopyFailed:
    return CopyFailed(f"{uri.rstrip('/')}/{key} changed while the node relay copied it ({was} became {now})")


def copy_weights(listing: Listing, fs: Any, prefix: str, store: Any, store_key: str, base: Path, key: str,
                 final: Path) -> int:
    """Every weight object of *listing* into a staging directory, in ranges read in parallel,
    pinned to the listed versions; renamed to *final* once whole. Raises :class:`CopyFailed`
    (nothing left behind) for what the relay cannot help."""
    staging = Staging(base, label=label_of(key))
    jobs: list[tuple[Any, int, int, int]] = []  # (source, fd, offset, length)
    sources: list[Any] = []
    outs: list[Any] = []
    progress = _Progress()
    try:
        for f in listing.weights:
            out = staging.create(PurePosixPath(f.key), mode=0o600)
            outs.append(out)
            try:  # reserve the whole object now: a full directory fails here, before any GET
                os.posix_fallocate(out.fileno(), 0, f.size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise CopyFailed(full_message(base, listing.weight_bytes)) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(out.fileno(), f.size)
            src = fs.open_input_file(f"{prefix}/{f.key}")  # random access: ranged GETs, bytes as stored
            sources.append(src)
            seen = identity_of(metadata_of(src))
            if src.size() != f.size or (PIN_VERSIONS and f.identity and seen and seen != f.identity):
                raise _changed(listing.uri, f.key, f"{f.size} bytes, {f.identity}", f"{src.size()} bytes, {seen}")
            jobs.extend((src, out.fileno(), off, min(RANGE_BYTES, f.size - off)) for off in range(0, f.size, RANGE_BYTES))

        def copy(job: tuple[Any, int, int, int]) -> int:
            src, fd, off, length = job
            data = read_range(src, off, length, listing.uri, progress)
            if len(data) != length:
                raise CopyFailed(f"short read from {listing.uri} ({len(data)} of {length} bytes at offset {off}): "
                                 "the object changed or the store cut the reply")
            view = memoryview(data)
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done:], off + done)
            progress.add()
            return length

        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rrs-relay") as pool:
            got = sum(pool.map(copy, jobs))
        if PIN_VERSIONS:  # the other end of the pin: each object still the version the copy began with
            now = run_all(probe_identity, listing.weights, fs, prefix, listing.uri, store)
            for f, seen in zip(listing.weights, now):
                if f.identity and seen != f.identity:
                    raise _changed(listing.uri, f.key, f.identity, seen)
        marker = {
            "uri": listing.uri, "store": store_key, "bytes": got, "key": key,
            "files": {f.key: {"size": f.size, "identity": f.identity} for f in listing.weights},
            "verified": ("every object's size, and its identity when listed, when opened and after its last "
                         "range" if PIN_VERSIONS else "sizes only"),
            "made": time.time(),
        }
        with staging.create(PurePosixPath(MARKER), mode=0o600) as out:
            out.write(json.dumps(marker).encode())
        staging.commit(final)
        return got
    except BaseException as e:
        staging.discard()
        if isinstance(e, ShimError):  # a store fault in the fetch's words (e.g. the closing HEAD)
            raise CopyFailed(str(e)) from e
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CopyFailed(full_message(base, listing.weight_bytes)) from e
        if isinstance(e, OSError):
            raise CopyFailed(f"reading {listing.uri} failed: {redact_text(str(e).splitlines()[0][:300])}") from e
        raise
    finally:
        for out in outs:
            try:
                out.close()
            except OSError:
                pass
        for src in sources:
            try:
                src.close()
            except OSError:
                pass


def full_message(base: Path, nbytes: int) -> str:
    return (f"the relay directory {base} filled up ({human_bytes(memory.fs_free(base) or 0)} free, "
            f"{human_bytes(nbytes)} needed; /dev/shm is shared with Ray's object store and NCCL): set "
            f"{RELAY_DIR} to a larger memory-backed directory")

