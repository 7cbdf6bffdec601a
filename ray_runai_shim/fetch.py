"""Fetch the non-weight files of an object-store model into a local directory.

Why not Ray's own download: on 2.45-2.49 it has no way to skip weights, reads
every object whole into memory, writes straight to final names (a crash
leaves a truncated file that the next run trusts), re-downloads on every call,
and shares one lock per model with other download modes. This module fixes
each of those for the small set of files vLLM reads locally:

* one listing, one classifier (:mod:`.files`), keys validated before writing;
* bounded-memory chunked copies through Ray's own pyarrow filesystem;
* everything is written to a staging directory that is renamed into place
  only when complete, and a manifest (keys, sizes, mtimes) decides reuse;
* a lock of its own, so a narrowed snapshot is never mistaken for Ray's full
  one and concurrent actors on a node fetch each file once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional

from .endpoint import s3_endpoint
from .errors import ShimError
from .files import STREAMABLE_SUFFIXES, is_weight_file, plan_local_paths

CHUNK_BYTES = 8 << 20
MAX_WORKERS = 8
LOCK_TIMEOUT_S = float(os.environ.get("RAY_RUNAI_SHIM_LOCK_TIMEOUT", "1800"))
MANIFEST = ".ray-runai-shim.json"


@dataclass
class RemoteFile:
    key: str  # relative to the model prefix
    size: int
    mtime_ns: Optional[int]


@dataclass
class Listing:
    uri: str
    nonweights: list[RemoteFile]
    weights: list[RemoteFile]

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.weights)

    @property
    def nonweight_bytes(self) -> int:
        return sum(f.size for f in self.nonweights)


@dataclass
class FetchResult:
    local_dir: str
    listing: Listing
    fetched_files: int = 0
    fetched_bytes: int = 0
    reused: bool = False
    seconds: float = 0.0


FsAndPath = Callable[[str], tuple[Any, str]]


def default_fs_and_path(uri: str) -> tuple[Any, str]:
    """Ray's own filesystem layer (already endpoint-aware once the shim is installed)."""
    from ray.llm._internal.common.utils.cloud_utils import CloudFileSystem

    return CloudFileSystem.get_fs_and_path(uri)


def _describe_endpoint() -> str:
    ep = s3_endpoint()
    return f"endpoint {ep}" if ep else "the default AWS endpoint (AWS_ENDPOINT_URL is not set)"


def list_model(uri: str, fs_and_path: FsAndPath = default_fs_and_path) -> Listing:
    """List every object under the model prefix and split weights from the rest."""
    import pyarrow.fs as pa_fs

    fs, prefix = fs_and_path(uri)
    prefix = prefix.rstrip("/")
    try:
        infos = fs.get_file_info(pa_fs.FileSelector(prefix, recursive=True))
    except FileNotFoundError:
        infos = []
    except OSError as e:
        raise ShimError(
            f"ray-runai-shim: cannot list {uri} via {_describe_endpoint()}: {e}. "
            "Check the bucket name, the credentials the actors see (AWS_ACCESS_KEY_ID/"
            "AWS_PROFILE/instance role), and AWS_ENDPOINT_URL for S3-compatible stores."
        ) from e
    nonweights: list[RemoteFile] = []
    weights: list[RemoteFile] = []
    for info in infos:
        if info.type != pa_fs.FileType.File:
            continue
        key = info.path[len(prefix) :].lstrip("/")
        mtime = getattr(info, "mtime_ns", None)
        rf = RemoteFile(key, int(info.size or 0), int(mtime) if mtime is not None else None)
        (weights if is_weight_file(key) else nonweights).append(rf)
    if not nonweights and not weights:
        raise ShimError(
            f"ray-runai-shim: no objects under {uri} (via {_describe_endpoint()}). "
            "Check the model_source prefix: it must be the folder that holds config.json."
        )
    nonweights.sort(key=lambda f: f.key)
    weights.sort(key=lambda f: f.key)
    return Listing(uri, nonweights, weights)


def check_streamable(listing: Listing, load_format: str, engine_kwargs: dict[str, Any]) -> None:
    """Fail before the engine starts when the streamer would find nothing to read."""
    suffix = STREAMABLE_SUFFIXES.get(load_format)
    if suffix is None:
        return
    if load_format == "tensorizer" and (engine_kwargs.get("model_loader_extra_config") or {}).get(
        "tensorizer_uri"
    ):
        return
    if any(f.key.lower().endswith(suffix) for f in listing.weights):
        return
    found = sorted({PurePosixPath(f.key).suffix for f in listing.weights}) or ["no weight files"]
    raise ShimError(
        f"ray-runai-shim: load_format={load_format!r} streams {suffix} files, but {listing.uri} "
        f"holds none (found: {', '.join(found)}). Convert the checkpoint to {suffix} "
        "or use load_format='auto' to let Ray download it."
    )


def cache_root() -> Path:
    """Where narrowed snapshots live: next to Ray's own model cache."""
    explicit = os.environ.get("RAY_RUNAI_SHIM_CACHE_DIR") or os.environ.get("TRANSFORMERS_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE).expanduser()
    except Exception:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
        )
        return Path(home, "hub").expanduser()


def snapshot_dir(uri: str, root: Optional[Path] = None) -> Path:
    """A directory per URI, named apart from Ray's ``models--…`` full snapshots."""
    flat = uri.rstrip("/").replace("://", "--").replace("/", "--").replace("@", "-")
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:10]
    return (root or cache_root()) / "ray-runai-shim" / f"{flat[:120]}-{digest}"


def _manifest(listing: Listing) -> dict[str, Any]:
    return {
        "source": listing.uri.rstrip("/"),
        "files": {f.key: [f.size, f.mtime_ns] for f in listing.nonweights},
        "weights": {f.key: f.size for f in listing.weights},
    }


def _is_complete(dest: Path, listing: Listing) -> bool:
    try:
        recorded = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    want = _manifest(listing)
    if recorded.get("source") != want["source"] or recorded.get("files") != want["files"]:
        return False
    paths = plan_local_paths(want["files"])
    return all(
        (dest / paths[k]).is_file() and (dest / paths[k]).stat().st_size == size
        for k, (size, _mtime) in want["files"].items()
    )


def _copy_one(fs: Any, src: str, dst: Path, expected: int) -> int:
    dst.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with fs.open_input_stream(src) as fin, open(dst, "wb") as fout:
        while True:
            chunk = fin.read(CHUNK_BYTES)
            if not chunk:
                break
            fout.write(chunk)
            written += len(chunk)
    if written != expected:
        raise OSError(f"{src}: got {written} bytes, listing said {expected}")
    return written


class _Progress:
    """One log line every few seconds for large non-weight sets; silent for small ones."""

    EVERY_S = 5.0

    def __init__(self, uri: str, files: int, nbytes: int) -> None:
        self.uri, self.files, self.nbytes = uri, files, nbytes
        self.done = self.done_bytes = 0
        self.last = time.perf_counter()

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.done_bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= self.EVERY_S and self.done < self.files:
            from .log import human_bytes, logger

            self.last = now
            logger.info(
                "ray-runai-shim: fetching non-weight files of %s: %d/%d files, %s/%s",
                self.uri, self.done, self.files, human_bytes(self.done_bytes), human_bytes(self.nbytes),
            )


def fetch_nonweights(
    uri: str,
    load_format: str,
    engine_kwargs: Optional[dict[str, Any]] = None,
    fs_and_path: FsAndPath = default_fs_and_path,
    root: Optional[Path] = None,
) -> FetchResult:
    """List, validate, and materialise the non-weight files of *uri* locally."""
    from filelock import FileLock

    start = time.perf_counter()
    listing = list_model(uri, fs_and_path)
    check_streamable(listing, load_format, engine_kwargs or {})
    paths = plan_local_paths([f.key for f in listing.nonweights])
    dest = snapshot_dir(uri, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    result = FetchResult(local_dir=str(dest), listing=listing)

    with FileLock(str(dest) + ".lock", timeout=LOCK_TIMEOUT_S):
        if _is_complete(dest, listing):
            result.reused = True
            result.seconds = time.perf_counter() - start
            return result
        fs, prefix = fs_and_path(uri)
        prefix = prefix.rstrip("/")
        staging = dest.parent / f".{dest.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            progress = _Progress(uri, len(listing.nonweights), listing.nonweight_bytes)
            with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, max(1, len(paths)))) as pool:
                futures = [
                    pool.submit(_copy_one, fs, f"{prefix}/{f.key}", staging / paths[f.key], f.size)
                    for f in listing.nonweights
                ]
                sizes = []
                for fut in as_completed(futures):
                    sizes.append(fut.result())
                    progress.step(sizes[-1])
            (staging / MANIFEST).write_text(json.dumps(_manifest(listing), indent=1, sort_keys=True))
            old = None
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(dest, old)
            os.rename(staging, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, OSError):
                raise ShimError(
                    f"ray-runai-shim: fetching the non-weight files of {uri} via "
                    f"{_describe_endpoint()} failed: {e}. Nothing was left behind; rerun once "
                    "the store is reachable."
                ) from e
            raise
    result.fetched_files = len(sizes)
    result.fetched_bytes = sum(sizes)
    result.seconds = time.perf_counter() - start
    return result
