"""Find weight bytes that reached local disk, by name or by content.

The point of streaming is that no weight file is ever written locally. A file
can land under any name (HF cache blobs have hash names), so a file counts if
it has a weight-like suffix, or if its size and sha256 match a known weight.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Union

__all__ = ["WEIGHT_SUFFIXES", "find_weight_bytes", "sha256_file"]

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".h5",
    ".msgpack",
    ".tensors",
)

#: A known weight: its original file, or its sha256 (hex str or 32 raw bytes).
WeightRef = Union[Path, str, bytes]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(ref: WeightRef) -> tuple[int | None, str]:
    if isinstance(ref, Path):
        return ref.stat().st_size, sha256_file(ref)
    if isinstance(ref, bytes):
        return None, ref.hex() if len(ref) == 32 else ref.decode().lower()
    return None, ref.lower()


def find_weight_bytes(roots: Iterable[Path], weights: Mapping[str, WeightRef]) -> list[Path]:
    """Files under ``roots`` (missing roots skipped) that look like or ARE weight files.

    ``weights`` maps a name (for messages only) to the original file -- whose size
    is then used as a cheap pre-filter -- or to its sha256. Symlinks to files are
    checked (their target's content); directory symlinks are not followed.
    """
    known = [_digest(ref) for ref in weights.values()]
    sizes = {size for size, _ in known}
    any_size = None in sizes
    digests = {digest for _, digest in known}
    found: set[Path] = set()
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                path = Path(dirpath, name)
                if name.lower().endswith(WEIGHT_SUFFIXES):
                    found.add(path)
                    continue
                try:
                    size = path.stat().st_size
                    if (any_size or size in sizes) and size > 0 and sha256_file(path) in digests:
                        found.add(path)
                except OSError:
                    continue  # dangling symlink, vanished or unreadable file
    return sorted(found)
