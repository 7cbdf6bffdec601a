"""Fetch the non-weight files of an object-store model into a local directory.

Why not Ray's own download: on 2.45-2.49 it has no way to skip weights, reads
every object whole into memory, writes straight to final names (a crash
leaves a truncated file that the next run trusts), re-downloads on every call,
and shares one lock per model with other download modes. This module fixes
each of those for the small set of files vLLM reads locally:

* the URI checked before any request, then one listing, one classifier (:mod:`.files`),
  keys validated before writing, and a pre-check of what vLLM and the streamer will
  find (config.json, streamable weights);
* reuse decided by the store's content identity (S3 ETag, GCS generation),
  never by size and mtime (S3 gives mtimes to the second);
* bounded-memory chunked copies, byte for byte whatever the name (no suffix-based
  decompression), through Ray's own pyarrow filesystem into a
  private staging directory, renamed into a new versioned directory only when
  complete (:mod:`.cache`: store-aware keys, reader locks, ownership checks);
* a fault raises ``ShimError`` naming its cause and fix (:mod:`.diagnose`):
  store and local-disk faults alike; a cache that cannot be used means a
  private directory, never a silent fall-back to copying the weights.
"""

from __future__ import annotations

import errno
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional

from ..diagnostics.diagnose import classify_store, local_error, store_error
from ..errors import ShimError
from ..redact import has_userinfo, shown_uri
from ..stores.endpoint import Store, refuse_endpoint_credentials, store_identity
from ..tables import schemes, settings
from ..tables.support import join_anonymous, split_anonymous
from . import cache
from .cache import MANIFEST, CacheUnusable, Place, cache_root
from .files import STREAMABLE_SUFFIXES, is_weight_file, plan_local_paths
from .staging import Staging

__all__ = [
    "MANIFEST",
    "FetchResult",
    "Listing",
    "RemoteFile",
    "cache_root",
    "check_model_config",
    "check_source",
    "check_streamable",
    "identity_of",
    "metadata_of",
    "open_store",
    "probe_identity",
    "run_all",
    "default_fs_and_path",
    "fetch_nonweights",
    "list_model",
]

CHUNK_BYTES = 8 << 20
MAX_WORKERS = 8
#: Every read passes this: pyarrow's default (``"detect"``) inflates ``*.gz``/``*.bz2``/``*.zst``/
#: ``*.lz4`` objects by name, so they would not arrive as stored (and plain text named ``.gz``
#: would fail to decode). vLLM and transformers expect the store's bytes.
AS_STORED = None


@dataclass
class RemoteFile:
    key: str  # relative to the model prefix
    size: int
    mtime_ns: Optional[int]
    identity: Optional[str] = None  # "etag:…", "generation:…"; filled in by the fetch


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
    private: bool = False  # fetched into the private fallback, not the shared cache


FsAndPath = Callable[[str], tuple[Any, str]]


def default_fs_and_path(uri: str) -> tuple[Any, str]:
    """Ray's own filesystem layer (already endpoint-aware once the shim is installed).

    Ray 2.45-2.52 have ``CloudFileSystem.get_fs_and_path``; 2.53 moved it to the pyarrow
    backend (``cloud_filesystem.pyarrow_filesystem.PyArrowFileSystem``)."""
    from ray.llm._internal.common.utils.cloud_utils import CloudFileSystem

    get = getattr(CloudFileSystem, "get_fs_and_path", None)
    if get is None:
        from ray.llm._internal.common.utils.cloud_filesystem.pyarrow_filesystem import PyArrowFileSystem

        get = PyArrowFileSystem.get_fs_and_path
    return get(uri)


def check_source(uri: str) -> None:
    """Refuse, before any request, a model URI that cannot name one model folder.

    pyarrow refuses an empty path segment (``s3://b//p``) itself, but in words that read as a
    credentials problem; and user-info before the bucket is a secret, not a bucket name."""
    plain, anonymous = split_anonymous(uri)
    scheme, sep, rest = plain.partition("://")
    if scheme.lower() not in schemes.S3 + schemes.GCS:
        return  # a local path, or Azure's container@account form: not judged here
    shown = shown_uri(uri)
    if has_userinfo(plain):
        raise ShimError(
            f"ray-runai-shim: the model URI {shown} carries credentials before the bucket name. Credentials do "
            f"not belong in the model URI. Fix: write {scheme}://<bucket>/<path> and give the workers "
            "credentials the usual way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or the node's "
            "own identity; for Google Cloud, GOOGLE_APPLICATION_CREDENTIALS or the node's service account)."
        )
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise ShimError(
            f"ray-runai-shim: the model URI {shown} names no bucket (nothing between '{scheme}://' and the "
            f"next '/'). Fix: write {scheme}://<bucket>/<folder that holds config.json>."
        )
    segments = path.rstrip("/").split("/") if path.strip("/") else []
    if "" in segments:
        before = "/".join([bucket, *segments[: segments.index("")]])
        fixed = f"{scheme}://" + "/".join([bucket, *(p for p in segments if p)])
        raise ShimError(
            f"ray-runai-shim: the model URI {shown} has an empty path segment ('//' after '{before}'). Object "
            "stores keep 'a//b' and 'a/b' as different keys, and pyarrow (Ray's store client) refuses an "
            "empty segment, so this cannot be listed as a model folder. Fix: write "
            f"{join_anonymous(fixed) if anonymous else fixed} (one '/' between segments); if the objects' keys "
            "really contain '//', copy them to a prefix without it."
        )


#: What vLLM reads to learn the model: config.json, or params.json (Mistral's own format).
CONFIG_FILES = ("config.json", "params.json")


def check_model_config(listing: Listing, engine_kwargs: Optional[dict[str, Any]] = None) -> None:
    """Fail at listing time when the prefix has no config.json at its top: the snapshot would
    be handed to vLLM as its model folder, and vLLM would fail only after the engine started."""
    if (engine_kwargs or {}).get("hf_config_path"):
        return  # the config comes from elsewhere
    keys = {f.key for f in listing.nonweights}
    if keys & set(CONFIG_FILES):
        return
    uri = shown_uri(listing.uri).rstrip("/")
    nested = sorted((k for k in keys if k.rsplit("/", 1)[-1] == "config.json"), key=lambda k: (k.count("/"), k))
    where = f" (found {nested[0]}: use {uri}/{nested[0].rsplit('/', 1)[0]})" if nested else ""
    raise ShimError(
        f"ray-runai-shim: {uri} has no config.json at the top of the prefix (it holds {len(listing.weights)} "
        f"weight and {len(listing.nonweights)} other files), so vLLM would fail on it only after the engine "
        f"started. Fix: point model_source at the folder that holds config.json{where}, or upload the model's "
        "config.json next to its weights. Nothing was fetched."
    )


def open_store(uri: str, fs_and_path: FsAndPath) -> tuple[Any, str, Store]:
    check_source(uri)
    refuse_endpoint_credentials(uri)  # before any request: the SDK would only say "host does not resolve"
    try:
        fs, prefix = fs_and_path(uri)
    except (OSError, ValueError) as e:
        if isinstance(e, ShimError):
            raise
        store = Store(uri.partition("://")[0].lower(), "", True)
        raise store_error(e, uri=uri, store=store, action="list") from None
    return fs, prefix.rstrip("/"), store_identity(fs, uri)


OpenStore = tuple[Any, str, Store]


def list_model(uri: str, fs_and_path: FsAndPath = default_fs_and_path, opened: Optional[OpenStore] = None) -> Listing:
    """List every object under the model prefix and split weights from the rest (*opened*: what
    :func:`open_store` gave the caller already, so the store is opened once)."""
    import pyarrow.fs as pa_fs

    fs, prefix, store = opened or open_store(uri, fs_and_path)
    try:
        infos = fs.get_file_info(pa_fs.FileSelector(prefix, recursive=True))
    except FileNotFoundError as e:
        # GCS lists a missing prefix as empty: its only 404 here is the bucket's (whatever
        # the server's words; fake-gcs-server says just "Not Found").
        if store.is_gcs or classify_store(str(e)) == "no-bucket":
            raise store_error(e, uri=uri, store=store, action="list", cause="no-bucket") from None
        infos = []  # S3: a missing prefix
    except ShimError:
        raise
    except (OSError, ValueError) as e:  # pyarrow: ArrowIOError is an OSError, ArrowInvalid a ValueError
        raise store_error(e, uri=uri, store=store, action="list") from None
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
            f"ray-runai-shim: no objects under {uri} (via {store.describe()}). "
            "Check the model_source prefix: it must be the folder that holds config.json."
        )
    nonweights.sort(key=lambda f: f.key)
    weights.sort(key=lambda f: f.key)
    return Listing(uri, nonweights, weights)


def check_streamable(listing: Listing, load_format: str, engine_kwargs: dict[str, Any]) -> None:
    """Fail before the engine starts when the streamer would find nothing to read.

    The streamer lists the top level of the prefix only, and tensorizer reads
    ``<uri>/model.tensors``: safetensors in sub-folders (``original/``, ``lora/``) or
    another tensors file name would otherwise fail late, after the engine started."""
    suffix = STREAMABLE_SUFFIXES.get(load_format)
    if suffix is None:
        return
    if load_format == "tensorizer":
        if (engine_kwargs.get("model_loader_extra_config") or {}).get("tensorizer_uri"):
            return
        if any(f.key == "model.tensors" for f in listing.weights):
            return
    elif any(f.key.lower().endswith(suffix) and "/" not in f.key for f in listing.weights):
        return
    matching = sorted(f.key for f in listing.weights if f.key.lower().endswith(suffix))
    if load_format == "tensorizer":
        found = ", ".join(matching[:5]) or "no .tensors file"
        raise ShimError(
            f"ray-runai-shim: load_format='tensorizer' reads {listing.uri.rstrip('/')}/model.tensors, "
            f"which does not exist (found: {found}). Name the serialized file model.tensors, set "
            "model_loader_extra_config={'tensorizer_uri': '<uri of the .tensors file>'}, or use "
            "load_format='auto'."
        )
    if matching:
        shown = ", ".join(matching[:5]) + (", …" if len(matching) > 5 else "")
        raise ShimError(
            f"ray-runai-shim: load_format={load_format!r} streams the {suffix} files at the top of "
            f"{listing.uri}, but it holds them only in sub-folders ({shown}); the streamer does not "
            "look into sub-folders. Point model_source at the folder that holds the weights, or "
            "move them to the top of the prefix."
        )
    found = sorted({PurePosixPath(f.key).suffix for f in listing.weights}) or ["no weight files"]
    raise ShimError(
        f"ray-runai-shim: load_format={load_format!r} streams {suffix} files, but {listing.uri} "
        f"holds none (found: {', '.join(found)}). Convert the checkpoint to {suffix} "
        "or use load_format='auto' to let Ray download it."
    )


# --------------------------------------------------------------------------- identity

#: Metadata fields that change whenever an object's content does, best first.
_IDENTITY_FIELDS = (("generation", "generation"), ("ETag", "etag"), ("etag", "etag"), ("md5Hash", "md5"))


def identity_of(metadata: Any) -> Optional[str]:
    if not metadata:
        return None
    for field, label in _IDENTITY_FIELDS:
        value = metadata.get(field)
        if value is None:
            value = metadata.get(field.encode())
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if value and str(value).strip() and str(value).strip() != "0":
            return f"{label}:{str(value).strip()}"
    return None


def metadata_of(stream: Any) -> Any:
    try:
        return stream.metadata()
    except (OSError, NotImplementedError, AttributeError):
        return None


def probe_identity(f: RemoteFile, fs: Any, prefix: str, uri: str, store: Store) -> Optional[str]:
    """The object's content identity (S3: a HEAD; GCS: an object-metadata request)."""
    src = f"{prefix}/{f.key}"
    try:
        with fs.open_input_stream(src, compression=AS_STORED) as stream:
            return identity_of(metadata_of(stream))
    except OSError as e:
        raise store_error(e, uri=f"{uri.rstrip('/')}/{f.key}", store=store, action="read") from None


def run_all(fn: Callable[..., Any], items: list[Any], *args: Any) -> list[Any]:
    """*fn(item, *args)* for every item on a small thread pool; the first error wins and
    the rest are cancelled."""
    if not items:
        return []
    out: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(items))) as pool:
        futures: dict[Future, int] = {pool.submit(fn, item, *args): i for i, item in enumerate(items)}
        try:
            for fut in as_completed(futures):
                out[futures[fut]] = fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return [out[i] for i in range(len(items))]


# --------------------------------------------------------------------------- copy


class _Changed(Exception):
    """An object changed between the listing and the fetch."""


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
            from ..log import human_bytes, logger

            self.last = now
            logger.info(
                "ray-runai-shim: fetching non-weight files of %s: %d/%d files, %s/%s",
                self.uri, self.done, self.files, human_bytes(self.done_bytes), human_bytes(self.nbytes),
            )


@dataclass
class _Job:
    fs: Any
    prefix: str
    uri: str
    store: Store
    staging: Staging
    paths: dict[str, PurePosixPath]
    total: int
    progress: _Progress


def _copy_one(f: RemoteFile, job: _Job) -> tuple[int, str, Optional[str]]:
    """Copy one object into the staging dir: (bytes, sha256, identity seen)."""
    src = f"{job.prefix}/{f.key}"
    obj_uri = f"{job.uri.rstrip('/')}/{f.key}"
    rel = job.paths[f.key]
    dst = job.staging.path / rel
    h = hashlib.sha256()
    written = 0
    try:
        fin = job.fs.open_input_stream(src, compression=AS_STORED)
    except OSError as e:
        raise store_error(e, uri=obj_uri, store=job.store, action="read") from None
    with fin:
        seen = identity_of(metadata_of(fin))
        try:
            fout = job.staging.create(rel)
        except OSError as e:
            raise local_error(e, path=dst, uri=job.uri, nbytes=job.total) from e
        try:
            with fout:
                while True:
                    try:
                        chunk = fin.read(CHUNK_BYTES)
                    except OSError as e:
                        raise store_error(e, uri=obj_uri, store=job.store, action="read") from None
                    if not chunk:
                        break
                    fout.write(chunk)
                    h.update(chunk)
                    written += len(chunk)
        except ShimError:
            raise
        except OSError as e:  # write() or the flush on close
            raise local_error(e, path=dst, uri=job.uri, nbytes=job.total) from e
    if written != f.size:
        raise _Changed(f"{obj_uri}: listed {f.size} bytes, read {written}")
    job.progress.step(written)
    return written, h.hexdigest(), seen


def _staging(place: Place, uri: str, nbytes: int) -> Staging:
    try:
        return Staging(place.base)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CacheUnusable(f"cannot create a directory in {place.base}: {e.strerror}") from e
        raise local_error(e, path=place.base, uri=uri, nbytes=nbytes) from e


def _materialise(
    place: Place, listing: Listing, paths: dict[str, PurePosixPath], fs: Any, prefix: str, store: Store
) -> FetchResult:
    """Reuse the cache's complete version of these files, or copy them into a new one (the reuse
    policy is the cache's: :func:`.cache.reusable`, :func:`.cache.commit_version`)."""
    uri = listing.uri
    store_key = store.key()
    group = cache.group_name(uri, store_key)
    result = FetchResult(local_dir="", listing=listing, private=place.private)
    ids: dict[str, tuple[int, str]] = {f.key: (f.size, f.identity or "") for f in listing.nonweights}
    known = all(f.identity for f in listing.nonweights)

    def reused(v: Path) -> FetchResult:
        result.local_dir, result.reused = str(v), True
        return result

    if known:  # the common case: decide before taking the fetch lock
        vdir, ok = cache.reusable(place, group, uri, store_key, ids, paths)
        if ok:
            return reused(vdir)

    with cache.fetch_lock(place.base, group, cache.lock_timeout()):
        if known:
            vdir, ok = cache.reusable(place, group, uri, store_key, ids, paths)
            if ok:
                return reused(vdir)  # another process fetched it while we waited
        cache.cleanup(place)  # staging dirs of dead processes, trash
        staging = _staging(place, uri, listing.nonweight_bytes)
        try:
            job = _Job(fs, prefix, uri, store, staging, paths, listing.nonweight_bytes,
                       _Progress(uri, len(listing.nonweights), listing.nonweight_bytes))
            copied = run_all(_copy_one, listing.nonweights, job)
            files: dict[str, dict[str, Any]] = {}
            for f, (size, sha, seen) in zip(listing.nonweights, copied):
                if known and seen is not None and seen != f.identity:
                    raise _Changed(f"{uri.rstrip('/')}/{f.key}: {f.identity} became {seen}")
                files[f.key] = {"size": size, "id": f.identity if known else f"sha256:{sha}", "sha256": sha}
            result.fetched_files = len(copied)
            result.fetched_bytes = sum(c[0] for c in copied)
            if not known:  # the store gives no identity: name the version by content
                ids = {k: (v["size"], v["id"]) for k, v in files.items()}
                vdir, ok = cache.reusable(place, group, uri, store_key, ids, paths)
                if ok:
                    staging.discard()
                    result.local_dir = str(vdir)
                    return result
            record = cache.manifest(uri, store_key, files, {w.key: w.size for w in listing.weights})
            try:
                cache.commit_version(place, group, vdir, staging, record)
            except OSError as e:
                raise local_error(e, path=vdir, uri=uri, nbytes=listing.nonweight_bytes) from e
        except BaseException:
            staging.discard()
            raise
        result.local_dir = str(vdir)
        return result


def fetch_nonweights(
    uri: str,
    load_format: str,
    engine_kwargs: Optional[dict[str, Any]] = None,
    fs_and_path: FsAndPath = default_fs_and_path,
    root: Optional[Path] = None,
) -> FetchResult:
    """List, validate, and materialise the non-weight files of *uri* locally.

    Raises only ``ShimError`` for foreseeable faults; never leaves a directory that a
    later run could take for a complete snapshot."""
    start = time.perf_counter()
    for attempt in (1, 2):
        fs, prefix, store = opened = open_store(uri, fs_and_path)
        listing = list_model(uri, fs_and_path, opened)
        check_streamable(listing, load_format, engine_kwargs or {})
        if load_format in STREAMABLE_SUFFIXES:  # not for tokenizer-only downloads ("auto"): they need no config
            check_model_config(listing, engine_kwargs)
        paths = plan_local_paths([f.key for f in listing.nonweights])
        idents = run_all(probe_identity, listing.nonweights, fs, prefix, uri, store)
        for f, ident in zip(listing.nonweights, idents):
            f.identity = ident
        place = cache.open_place(Path(root) if root is not None else None)
        try:
            while True:
                try:
                    result = _materialise(place, listing, paths, fs, prefix, store)
                    break
                except CacheUnusable as e:
                    if place.private:
                        raise ShimError(
                            f"ray-runai-shim: cannot use the private directory {place.base} for the "
                            f"non-weight files of {uri}: {e}. Set {settings.CACHE_DIR} to a "
                            "directory this user owns and can write."
                        ) from e
                    place = cache.private_place(f"cannot use the cache {place.base}: {e}")
        except _Changed as e:
            if attempt == 2:
                raise ShimError(
                    f"ray-runai-shim: the objects under {uri} changed while they were being fetched "
                    f"({e}), twice. Rerun once the upload to that prefix is complete. Nothing was "
                    "left behind."
                ) from e
            continue
        result.seconds = time.perf_counter() - start
        return result
    raise AssertionError("unreachable")
