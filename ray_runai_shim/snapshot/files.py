"""Which object keys are weights, and where a key may land on local disk.

One classifier decides for the whole shim (download, doctor, tests), so the
set of files vLLM streams and the set the shim fetches can never overlap.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath

from ..errors import ShimError

#: Suffixes of tensor payloads. These are streamed (or, for formats the
#: streamer cannot read, never worth copying just to read config).
WEIGHT_SUFFIXES: frozenset[str] = frozenset(
    {
        ".safetensors",  # runai_streamer / runai_streamer_sharded
        ".tensors",  # tensorizer
        ".bin",  # pytorch_model*.bin, training_args.bin
        ".pt",
        ".pth",  # original/consolidated.*.pth
        ".ckpt",
        ".gguf",
        ".ggml",
        ".h5",  # TF / Keras
        ".keras",
        ".msgpack",  # Flax
        ".onnx",
        ".ot",  # rust-bert
        ".npz",
        ".distcp",  # torch.distributed checkpoints
        ".nemo",
        ".pdparams",
        ".tflite",
        ".mlmodel",
    }
)

#: Suffixes that hold the weights the streaming formats can read at all.
STREAMABLE_SUFFIXES: dict[str, str] = {
    "runai_streamer": ".safetensors",
    "runai_streamer_sharded": ".safetensors",
    "tensorizer": ".tensors",
}


def is_weight_file(rel_path: str) -> bool:
    """True when *rel_path* names tensor data rather than config/tokenizer/code."""
    name = rel_path.rsplit("/", 1)[-1].lower()
    # ".onnx_data" and "model.safetensors.part" style names are weights too;
    # "model.safetensors.index.json" is not (its last suffix is .json).
    dot = name.rfind(".")
    if dot <= 0:
        return False
    suffix = name[dot:]
    if suffix in WEIGHT_SUFFIXES:
        return True
    return suffix in {".onnx_data", ".part"} and any(
        s in name for s in (".safetensors", ".bin", ".onnx")
    )


def safe_relative_path(key: str) -> PurePosixPath:
    """Map an object key (relative to the model prefix) to a local relative path.

    Ray's own download does ``os.path.join(dest, rel)`` unchecked, so a key such
    as ``../../.bashrc`` or ``/etc/passwd`` would be written outside the model
    directory. We refuse those instead of "fixing" them silently.
    """
    if not key or "\x00" in key or "\\" in key:
        raise ShimError(f"refusing object key {key!r}: empty, NUL or backslash in name")
    if key.startswith("/"):
        raise ShimError(f"refusing object key {key!r}: absolute path")
    parts = key.split("/")
    if any(p in ("..", ".") for p in parts):
        raise ShimError(f"refusing object key {key!r}: '.' or '..' path segment")
    path = PurePosixPath(*[p for p in parts if p])
    if not path.parts:
        raise ShimError(f"refusing object key {key!r}: no file name")
    return path


def plan_local_paths(keys: Iterable[str]) -> dict[str, PurePosixPath]:
    """Validate a whole listing at once: every key safe, no two keys on one path.

    Collisions (``a//b`` vs ``a/b``, or ``a`` as both file and folder) would make
    the result depend on download order, so the listing is refused before any
    byte is written.
    """
    out: dict[str, PurePosixPath] = {}
    seen: dict[PurePosixPath, str] = {}
    for key in keys:
        path = safe_relative_path(key)
        if path in seen:
            raise ShimError(
                f"refusing object keys {seen[path]!r} and {key!r}: both map to {str(path)!r}"
            )
        seen[path] = key
        out[key] = path
    for path, key in seen.items():
        for parent in path.parents:
            if parent in seen:
                raise ShimError(
                    f"refusing object keys {seen[parent]!r} and {key!r}: "
                    f"{str(parent)!r} would be both a file and a folder"
                )
    return out
