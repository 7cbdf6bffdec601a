"""The relay's copy: every weight object read from the store once, in parallel ranged GETs,
pinned to the version it was listed at, published range by range, renamed whole at the end.

What the copy guarantees (:mod:`.relay` decides when to make one and who holds it):

* one version of every object: each object's content identity (S3 ETag, GCS generation) is
  part of the key; it is read again when the object is opened, after each batch of ranges
  lands (before they are published to the readers) and after the last one, and any change
  refuses the copy (pyarrow, Ray's store client, sends no ``If-Match``: the pin brackets the
  ranges);
* nothing half visible: space reserved beside the first GETs (``posix_fallocate``: a full
  directory fails the copy within moments, and nothing partial is left), files created ``O_EXCL|O_NOFOLLOW`` in the copy's private directory (``.<key>.live``),
  a range listed in the progress record (:mod:`.relay_progress`) only once written and verified,
  a marker that records what was checked, one ``rename``;
* a killed fetcher costs only what it had not verified: the next one resumes from the record;
* a stalled range is read again while the copy makes progress elsewhere; whatever the copy
  cannot help (the store, the directory, a changed object) is :class:`CopyFailed`: the record
  says so to the readers (they stream), the bytes are freed at once.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from ..errors import ShimError
from ..log import human_bytes, logger
from ..redact import redact_text
from ..tables import settings
from . import memory, relay_progress
from .fetch import Listing, identity_of, metadata_of, probe_identity, run_all
from .staging import Staging, read_json

MARKER = ".ray-runai-shim-relay.json"
#: Ranges read at once: WORKERS x RANGE_BYTES in flight. Readers start on the first tensors
#: once their ranges land, so the window bounds when that is: 8 x 8 MiB on a 40 MB/s link lands
#: a first 64 MiB tensor after ~1.7 s, where 8 x 32 MiB ranges sharing the link took ~6.7 s
#: (./dev bench nodes). 8 MiB is the part size S3 documents for parallel ranged reads.
RANGE_BYTES = 8 << 20
WORKERS = 8
#: Each object's first range: its safetensors header (the grid of its other ranges starts
#: where the header ends). Small, so the heads of many shards take no window from the tensors.
HEAD_BYTES = 64 << 10
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
#: Tests turn this off to show what a killed fetcher costs without resuming its copy.
RESUME = True
#: How often written ranges are verified (one HEAD per object) and published to the readers.
VERIFY_S = 0.1
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


def live_name(key: str) -> str:
    """The directory a copy of *key* is made in, readable (range by range) while it is made."""
    return f".{key}.live"


def _open_copy_dir(base: Path, key: str, uri: str, files: list[tuple[str, int]]) -> tuple[Staging, Optional[dict]]:
    """The copy's directory, and the ranges a killed fetcher already verified there (None: start
    afresh; what was there is removed)."""
    staging = Staging(base, label=label_of(key), name=live_name(key))
    if not staging.adopted:
        return staging, None
    record = relay_progress.read_record(staging.fd)
    if RESUME and relay_progress.usable(record, files, uri):
        return staging, record["done"]
    staging.discard()  # a failed copy, or one of another layout: made again
    return Staging(base, label=label_of(key), name=live_name(key)), None


def _data_file(staging: Staging, key: str, size: int, resuming: bool) -> Any:
    rel = PurePosixPath(key)
    out = None
    if resuming:
        try:
            out = staging.open_existing(rel)
        except FileNotFoundError:
            out = None
    if out is None:
        out = staging.create(rel, mode=0o600, readable=True)
    if os.fstat(out.fileno()).st_size != size:
        os.ftruncate(out.fileno(), size)  # its whole size at once (sparse): a reader maps it whole
    return out


def _reserve(outs: list[Any], sizes: list[int]) -> None:
    """Reserve every object's memory (``posix_fallocate``), beside the first GETs rather than
    before them: zeroing 1 GiB takes a quarter second the first tensors need not wait for. A
    full directory still fails the copy within moments (ENOSPC), and nothing partial is left."""
    for out, size in zip(outs, sizes):
        try:
            os.posix_fallocate(out.fileno(), 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise


def _data_start(fd: int, f: Any) -> int:
    """Where a safetensors file's tensors begin (8 bytes, then the header), read from the copy's
    first range: the grid of the other ranges starts there. 0 when the object is not one."""
    if not f.key.endswith(".safetensors") or f.size < 8:
        return 0
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    return 8 + n if 8 + n <= f.size else 0


def copy_weights(listing: Listing, fs: Any, prefix: str, store: Any, store_key: str, base: Path, key: str,
                 final: Path, share: Optional[Any] = None) -> int:
    """Every weight object of *listing* into the copy's directory, in ranges read in parallel,
    pinned to the listed versions, each range published for the readers once verified
    (:mod:`.relay_progress`); renamed to *final* once whole. A copy a killed fetcher left is
    resumed from its verified ranges. Raises :class:`CopyFailed` (the record says so to the
    readers, the bytes are freed) for what the relay cannot help.

    *share* (:mod:`.relay_cluster`; or what makes it, called once the record exists): as the cluster's source, every verified range is also put
    into Ray's object store; as a peer, the ranges come from the source's node first, and what
    they do not bring is read from the store. Returns the bytes read from the store."""
    files = [(f.key, f.size) for f in listing.weights]
    staging, done = _open_copy_dir(base, key, listing.uri, files)
    opened: list[tuple[Any, Any, Any]] = []  # (object, source, file) of the objects still to copy
    sources: list[Any] = []
    outs: list[Any] = []
    progress = _Progress()
    publisher = relay_progress.Publisher(staging, listing.uri, files, done)
    reserver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rrs-relay-reserve")
    try:
        publisher.publish()  # the record exists before the first GET: readers see what is to come
        if callable(share):  # joined only now: however long the cluster takes, the readers find the copy
            share = share()
        if done:
            logger.info("ray-runai-shim: node relay: resuming the copy of %s: %s of %s already on this node",
                        listing.uri, human_bytes(publisher.bytes_done), human_bytes(publisher.total))
        for f in listing.weights:
            try:
                outs.append(_data_file(staging, f.key, f.size, done is not None))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise CopyFailed(full_message(base, listing.weight_bytes)) from e
                raise
        reserving = reserver.submit(_reserve, outs, [f.size for f in listing.weights])
        if share is not None and share.role == "peer":
            share.pull(publisher, {f.key: out.fileno() for f, out in zip(listing.weights, outs)})
        from_peer = publisher.bytes_done - publisher.resumed
        for f, out in zip(listing.weights, outs):
            if relay_progress.covers(publisher.done[f.key], 0, f.size):
                continue
            src = fs.open_input_file(f"{prefix}/{f.key}")  # random access: ranged GETs, bytes as stored
            sources.append(src)
            seen = identity_of(metadata_of(src))
            if src.size() != f.size or (PIN_VERSIONS and f.identity and seen and seen != f.identity):
                raise _changed(listing.uri, f.key, f"{f.size} bytes, {f.identity}", f"{src.size()} bytes, {seen}")
            opened.append((f, src, out))

        def copy(job: tuple[str, Any, int, int, int]) -> int:
            name, src, fd, off, length = job
            data = read_range(src, off, length, listing.uri, progress)
            if len(data) != length:
                raise CopyFailed(f"short read from {listing.uri} ({len(data)} of {length} bytes at offset {off}): "
                                 "the object changed or the store cut the reply")
            view = memoryview(data)
            n = 0
            while n < length:
                n += os.pwrite(fd, view[n:], off + n)
            progress.add()
            publisher.written(name, off, off + length)
            return length

        def rest(f: Any, src: Any, out: Any, have: relay_progress.Intervals) -> list[tuple[str, Any, int, int, int]]:
            """What the object still needs beyond *have*, on a grid that starts where its tensors
            do: whole tensors fill whole ranges, so the first tensors land as soon as their bytes."""
            return [(f.key, src, out.fileno(), off, length) for off, length in
                    relay_progress.missing(have, f.size, RANGE_BYTES, _data_start(out.fileno(), f))]

        # Each object's head first (a safetensors header is in it; small, so all of them land at
        # once), then each object's other ranges as soon as its own head is here (a stalled
        # object holds back only itself), on the grid of its tensors.
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rrs-relay") as pool:
            pending: set = set()
            then: dict = {}
            for f, src, out in opened:
                first = min(HEAD_BYTES, f.size)
                if relay_progress.covers(publisher.done[f.key], 0, min(8, f.size)):  # resumed: its header is here
                    pending.update(pool.submit(copy, job) for job in rest(f, src, out, publisher.done[f.key]))
                else:
                    fut = pool.submit(copy, (f.key, src, out.fileno(), 0, first))
                    then[fut] = (f, src, out)
                    pending.add(fut)
            try:
                while pending:
                    finished, pending = wait(pending, timeout=VERIFY_S, return_when=FIRST_EXCEPTION)
                    if reserving.done():
                        reserving.result()  # a directory that filled up fails the copy now
                    for fut in finished:
                        fut.result()
                        if fut in then:
                            f, src, out = then.pop(fut)
                            have = relay_progress.add(publisher.done[f.key], 0, min(HEAD_BYTES, f.size))
                            pending.update(pool.submit(copy, job) for job in rest(f, src, out, have))
                    _verify(publisher, listing, fs, prefix, store, every=False, share=share, outs=outs)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        reserving.result()
        # the pin's other end: every object's identity, after the last range
        _verify(publisher, listing, fs, prefix, store, every=True, share=share, outs=outs)
        got = publisher.bytes_done
        if got != listing.weight_bytes:
            raise CopyFailed(f"the copy of {listing.uri} ended with {got} of {listing.weight_bytes} bytes verified")
        marker = {
            "uri": listing.uri, "store": store_key, "bytes": got, "key": key,
            "files": {f.key: {"size": f.size, "identity": f.identity} for f in listing.weights},
            "verified": ("every object's size, and its identity when listed, when opened and after its ranges "
                         "landed" if PIN_VERSIONS else "sizes only"),
            "resumed_bytes": publisher.resumed,
            "made": time.time(),
        }
        publisher.finish(relay_progress.DONE)
        with staging.create(PurePosixPath(MARKER), mode=0o600) as out:
            out.write(json.dumps(marker).encode())
        staging.commit(final)
        if share is not None:
            share.finish(True)
        return got - publisher.resumed - from_peer
    except BaseException as e:
        failure = _as_failure(e, base, listing)
        publisher.finish(relay_progress.FAILED, str(failure or e))
        if share is not None:
            share.finish(False)
        for f in listing.weights:  # the bytes go as the readers let go (they stream); the record stays
            try:  # unlinked, never truncated: a reader's tensors map these pages (relay_read)
                staging.unlink(PurePosixPath(f.key))
            except OSError:
                pass
        staging.close()
        if failure is not None:
            raise failure from e
        raise
    finally:
        reserver.shutdown(wait=True)  # before the files close: never an fd number reused under it
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


def _as_failure(e: BaseException, base: Path, listing: Listing) -> Optional[CopyFailed]:
    if isinstance(e, CopyFailed):
        return e
    if isinstance(e, ShimError):  # a store fault in the fetch's words (e.g. a verifying HEAD)
        return CopyFailed(str(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CopyFailed(full_message(base, listing.weight_bytes))
    if isinstance(e, OSError):
        return CopyFailed(f"reading {listing.uri} failed: {redact_text(str(e).splitlines()[0][:300])}")
    return None


def _reader(listing: Listing, outs: list[Any]) -> Any:
    """Read a range back from the copy's file (what the cluster's source puts for other nodes)."""
    fds = {f.key: out.fileno() for f, out in zip(listing.weights, outs)}

    def read(key: str, off: int, length: int) -> bytes:
        data = os.pread(fds[key], length, off)
        if len(data) != length:
            raise OSError(f"a short read of the node copy ({len(data)} of {length} bytes)")
        return data

    return read


def _verify(publisher: relay_progress.Publisher, listing: Listing, fs: Any, prefix: str, store: Any,
            every: bool, share: Optional[Any] = None, outs: Optional[list[Any]] = None) -> None:
    """Publish the ranges written so far once their objects' identities, read now, are still the
    pinned ones (*every*: read every object's, the copy's last check), and offer them to the
    cluster (*share*). CopyFailed on a change."""
    written = publisher.take_written()
    if not written and not every:
        return
    if PIN_VERSIONS:
        check = [f for f in listing.weights if every or f.key in written]
        for f, seen in zip(check, run_all(probe_identity, check, fs, prefix, listing.uri, store)):
            if f.identity and seen != f.identity:
                raise _changed(listing.uri, f.key, f.identity, seen)
    publisher.verified(written)
    if share is not None and share.role == "source":  # for other nodes, once one asks
        share.offer(publisher, _reader(listing, outs or []))


def full_message(base: Path, nbytes: int) -> str:
    return (f"the relay directory {base} filled up ({human_bytes(memory.fs_free(base) or 0)} free, "
            f"{human_bytes(nbytes)} needed; /dev/shm is shared with Ray's object store and NCCL): set "
            f"{RELAY_DIR} to a larger memory-backed directory")

