"""Reading the node relay's copy while it is made: each tensor as soon as its bytes are here.

A reader of a copy in progress (:func:`open_live`) follows the copy's progress record
(:mod:`.relay_progress`): a safetensors header is parsed once its bytes are listed, and each
tensor is handed out once every byte of it is listed, in the order the fetch lands them, as
a private mapping of the copy's pages (``MAP_PRIVATE``: no copy, and a reader that writes to
its tensor writes to pages of its own, never to the node's copy). The record lists a range only
after it was written and its object's identity read again unchanged, so no tensor is ever
read from a range not yet whole, or of another version. Single-file checkpoints gain as much
as sharded ones: the unit is the tensor, not the file.

Whatever stops the copy (it failed, or nothing moved for ``STALL_S``) is :class:`Unavailable`,
with the source URI: the caller streams the whole checkpoint from the store instead (every
tensor again, so the model is of one version whatever it had read). A copy that is already
complete is not a live copy (:func:`open_live` returns None): it is read as files.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..log import human_bytes, logger
from . import relay_copy, relay_progress
from .relay_copy import live_name, read_marker

#: A reader that sees no new verified range for this long gives up on the copy and streams.
STALL_S = relay_copy.STALL_S
POLL_S = 0.01  # the first look after a tensor; doubled while nothing lands, up to MAX_POLL_S
MAX_POLL_S = 0.1
TELL_S = 10.0
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_O_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: safetensors dtype names -> torch attribute names.
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
          "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
          "C64": "complex64"}


class Unavailable(Exception):
    """The copy cannot be read to its end here: stream *uri* (when known) from the store."""

    def __init__(self, why: str, uri: Optional[str] = None) -> None:
        super().__init__(why)
        self.why = why
        self.uri = uri


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


@dataclass
class _File:
    key: str
    size: int
    fd: Optional[int] = None
    mapped: Any = None  # the whole file, mapped private once its header is here
    tensors: Optional[list[_Tensor]] = None  # None until the header is on the node
    waiting_since: float = field(default_factory=time.monotonic)


def open_live(final: Path) -> Optional[LiveCopy]:
    """The copy of *final* in progress, to read as it lands; None when the copy is complete
    (read its files). :class:`Unavailable` when there is neither."""
    for _ in range(20):
        if read_marker(final) is not None:
            return None
        try:
            dir_fd = os.open(final.parent / live_name(final.name), _O_DIR)
        except FileNotFoundError:  # renamed into place between the two looks, or not there at all
            time.sleep(0.05)
            continue
        record = relay_progress.read_record(dir_fd)
        if record is not None:
            return LiveCopy(final, dir_fd, record)
        os.close(dir_fd)
        time.sleep(0.05)
    if read_marker(final) is not None:
        return None
    raise Unavailable(f"no copy of it on this node ({final})")


class LiveCopy:
    """One reader's view of a copy in progress."""

    def __init__(self, final: Path, dir_fd: int, record: dict) -> None:
        self.final = final
        self._dir_fd = dir_fd
        self.record = record
        self.uri: str = str(record.get("uri") or "")
        self.files = [_File(str(k), int(n)) for k, n in record.get("files") or []]
        self.first_tensor_s: Optional[float] = None
        self._stamp: tuple = ()

    def close(self) -> None:
        for f in self.files:
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
            f.mapped = None  # unmapped when the last tensor on it goes (each holds a reference)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """Every tensor of the checkpoint, each once, as soon as its bytes are verified here."""
        started = last_move = told = time.monotonic()
        last_bytes = -1
        pause = POLL_S
        record = self.record
        try:
            while True:
                if record.get("state") == relay_progress.FAILED:
                    raise Unavailable(f"the copy failed ({str(record.get('why'))[:300]})", self.uri)
                done = record.get("done") or {}
                moved = False
                for f in self.files:
                    for name, tensor in self._ready(f, done.get(f.key) or []):
                        moved = True
                        if self.first_tensor_s is None:
                            self.first_tensor_s = time.monotonic() - started
                        yield name, tensor
                if all(f.tensors is not None and not f.tensors for f in self.files):
                    return
                now = time.monotonic()
                got = int(record.get("bytes") or 0)
                if moved or got > last_bytes:
                    last_move, last_bytes = now, got
                elif now - last_move >= STALL_S:
                    raise Unavailable(f"its copy made no progress for {STALL_S:.0f} s", self.uri)
                if now - told >= TELL_S and now - last_move >= 1.0:
                    told = now
                    logger.info("ray-runai-shim: node relay: waiting %.0f s for %s, copied %s of %s so far",
                                now - started, self._waiting_for(), human_bytes(got), human_bytes(
                                    int(record.get("total") or 0)))
                pause = POLL_S if moved else min(pause * 2, MAX_POLL_S)
                time.sleep(pause)
                record = self._newer(record)
        finally:
            self.close()

    def _newer(self, record: dict) -> dict:
        """The record again, parsed only when the fetcher replaced it since the last look."""
        try:
            st = os.stat(relay_progress.RECORD, dir_fd=self._dir_fd, follow_symlinks=False)
        except OSError:
            return record
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # each record is a new file (a rename): a new inode
        if stamp == self._stamp:
            return record
        self._stamp = stamp
        return relay_progress.read_record(self._dir_fd) or record

    def _waiting_for(self) -> str:
        for f in self.files:
            if f.tensors is None:
                return f"the header of {self.uri}/{f.key}"
            if f.tensors:
                return f"{f.tensors[0].name} in {self.uri}/{f.key}"
        return "the copy's end"

    def _open(self, f: _File) -> int:
        try:
            return self._open_file(f)
        except FileNotFoundError:  # the copy failed and its files went: the record says so next
            raise Unavailable(f"the copy's {f.key} is gone from this node", self.uri) from None

    def _open_file(self, f: _File) -> int:
        if f.fd is None:
            parts = f.key.split("/")
            parent = self._dir_fd
            opened: list[int] = []
            try:
                for part in parts[:-1]:
                    parent = os.open(part, _O_DIR, dir_fd=parent)
                    opened.append(parent)
                f.fd = os.open(parts[-1], _O_FILE, dir_fd=parent)
            finally:
                for fd in opened:
                    os.close(fd)
        return f.fd

    def _ready(self, f: _File, done: relay_progress.Intervals) -> Iterator[tuple[str, Any]]:
        if f.tensors is None:
            if not relay_progress.covers(done, 0, 8):
                return
            (n,) = struct.unpack("<Q", _pread(self._open(f), 8, 0))
            if n > MAX_HEADER or 8 + n > f.size:
                raise Unavailable(f"{f.key} is not a safetensors file (header of {n} bytes)", self.uri)
            if not relay_progress.covers(done, 0, 8 + n):
                return
            f.tensors = _parse_header(_pread(f.fd, n, 8), 8 + n, f.key, self.uri)
        ready = [t for t in f.tensors if relay_progress.covers(done, t.begin, t.end)]
        if not ready:
            return
        taken = {id(t) for t in ready}
        f.tensors = [t for t in f.tensors if id(t) not in taken]
        for t in ready:
            yield t.name, _tensor(f, t)


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise Unavailable(f"a short read of the node copy ({len(out)} of {n} bytes at {offset})")
        out += chunk
    return bytes(out)


def _parse_header(raw: bytes, data_start: int, key: str, uri: str) -> list[_Tensor]:
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise Unavailable(f"{key}'s safetensors header does not parse ({e})", uri) from None
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(str(meta.get("dtype")))
        if dtype is None:
            raise Unavailable(f"{key}: tensor {name} has dtype {meta.get('dtype')}, which this reader does not "
                              "know", uri)
        b, e = meta["data_offsets"]
        out.append(_Tensor(name, dtype, tuple(int(x) for x in meta["shape"]), data_start + int(b), data_start + int(e)))
    out.sort(key=lambda t: t.begin)
    return out


def _tensor(f: _File, t: _Tensor) -> Any:
    """One tensor over the copy's own pages: a private mapping, so no byte is copied until the
    caller copies it into its parameter, and a write to it stays the caller's. The file is never
    truncated under a mapping (a failed copy is unlinked: the pages live while mapped). A tensor
    whose offset is not aligned to its dtype is read into memory of its own instead."""
    import mmap

    import torch

    dtype = getattr(torch, t.dtype)
    width = torch.empty((), dtype=dtype).element_size()
    nbytes = t.end - t.begin
    if not nbytes or t.begin % width or nbytes % width:
        return _read_tensor(f.fd, t)
    if f.mapped is None:
        f.mapped = mmap.mmap(f.fd, f.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(f.mapped, dtype=dtype, count=nbytes // width, offset=t.begin).reshape(t.shape)


def _read_tensor(fd: int, t: _Tensor) -> Any:
    """One tensor, read from node memory straight into a tensor of its own."""
    import torch

    nbytes = t.end - t.begin
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        view = memoryview(buf.numpy())
        n = 0
        while n < nbytes:
            got = os.preadv(fd, [view[n:]], t.begin + n)
            if got <= 0:
                raise Unavailable(f"a short read of the node copy ({n} of {nbytes} bytes of {t.name})")
            n += got
    dtype = getattr(torch, t.dtype)
    return buf.view(dtype).reshape(t.shape)
