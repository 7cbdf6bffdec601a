"""The largest tensor of a safetensors checkpoint, read from the files' headers.

The streamer refuses a memory limit below its largest single read (one tensor: a read carries
one destination and cannot span two buffers), so a per-reader memory budget is floored there.
A header is the file's first 8 bytes (little-endian length) and that many bytes of JSON: two
small reads per file, local (the relay's copy) or ranged from the store.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 10**6


def largest_in_header(raw: bytes) -> int:
    """Bytes of the largest tensor in one decoded safetensors header."""
    header = json.loads(raw)
    sizes = [end - begin for name, entry in header.items() if name != "__metadata__"
             for begin, end in [entry["data_offsets"]]]
    return max(sizes, default=0)


def _largest(read_head: Callable[[int, int], bytes]) -> int:
    (length,) = struct.unpack("<Q", read_head(0, 8))
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ValueError(f"not a safetensors header (length {length})")
    return largest_in_header(read_head(8, length))


def largest_local(paths: Iterable[Path]) -> int:
    """The largest tensor over local safetensors files."""
    best = 0
    for path in paths:
        with open(path, "rb") as f:
            def read(offset: int, length: int, f: Any = f) -> bytes:
                f.seek(offset)
                return f.read(length)

            best = max(best, _largest(read))
    return best


def largest_remote(fs: Any, paths: Iterable[str]) -> int:
    """The largest tensor over safetensors objects in a store (pyarrow filesystem: ranged reads)."""
    best = 0
    for path in paths:
        with fs.open_input_file(path) as f:
            best = max(best, _largest(lambda offset, length, f=f: f.read_at(length, offset)))
    return best
