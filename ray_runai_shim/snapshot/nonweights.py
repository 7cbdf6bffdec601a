"""The non-weight snapshot for one stage context: what every consumer wrapper fetches.

The Ray Data stages (chat template, tokenize, vLLM, detokenize, the driver's
config read), Serve's node init and the tokenizer-only downloads all call
:func:`fetch_for`. Within one Ray job, the first caller on a node lists the
store and fetches (:mod:`.fetch`, which checks content identity); every later
caller of the same job on that node gets the same directory from a small
per-job record, under one lock, without touching the store again -- one
listing and one fetch per node for a whole pipeline. Outside a Ray job (no
job id) every call goes to :mod:`.fetch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from ..context import StageContext
from ..log import logger

JOBS_DIR = ".jobs"
RECORD_MAX_AGE_S = 7 * 24 * 3600


def _torch_kernels_dir() -> None:
    # Ray's download_model_files creates this before downloading; keep doing it.
    try:
        import torch
    except ImportError:
        return
    os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)


def _job_id() -> Optional[str]:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_job_id()
    except Exception:  # no job here (a plain interpreter, Ray Client): no record
        return None


def _record_path(job_id: str, uri: str) -> Optional[Path]:
    """This job's record for *uri*, in the cache place the fetch itself trusts (or None)."""
    from ..stores.endpoint import s3_endpoint
    from .cache import open_place

    key = hashlib.sha256(f"{job_id}\0{uri.rstrip('/')}\0{s3_endpoint() or ''}".encode()).hexdigest()[:24]
    try:
        jobs = open_place().base / JOBS_DIR
        jobs.mkdir(mode=0o700, exist_ok=True)
        if jobs.lstat().st_uid != os.getuid() or not jobs.is_dir():
            return None  # not ours: never trusted
    except OSError:
        return None
    return jobs / f"{key}.json"


def _stats(result: Any) -> dict[str, Any]:
    return {
        "fetched_files": result.fetched_files,
        "fetched_bytes": result.fetched_bytes,
        "nonweight_files": len(result.listing.nonweights),
        "weight_files": len(result.listing.weights),
        "weight_bytes": result.listing.weight_bytes,
        "reused": result.reused,
        "seconds": result.seconds,
    }


def _fetch(ctx: StageContext, load_format: str) -> tuple[str, dict[str, Any], list[list[Any]], list[str]]:
    from .fetch import fetch_nonweights

    result = fetch_nonweights(ctx.model, load_format, ctx.engine_kwargs)
    weights = [[f.key, f.size] for f in result.listing.weights]
    return result.local_dir, _stats(result), weights, [f.key for f in result.listing.nonweights]


def _check_recorded(
    ctx: StageContext, load_format: str, weights: list[list[Any]], nonweights: Optional[list[str]] = None
) -> None:
    """The streaming pre-checks, on the listing this job recorded (no second listing): a
    tokenizer-only download ("auto") may have made the record without them."""
    from .fetch import Listing, RemoteFile, check_model_config, check_streamable
    from .files import STREAMABLE_SUFFIXES

    listing = Listing(ctx.model, [RemoteFile(key, 0, None) for key in nonweights or []],
                      [RemoteFile(key, size, None) for key, size in weights])
    check_streamable(listing, load_format, ctx.engine_kwargs)
    if nonweights is not None and load_format in STREAMABLE_SUFFIXES:  # a record without a key list: nothing to check it against
        check_model_config(listing, ctx.engine_kwargs)


def _prune(jobs: Path) -> None:
    now = time.time()
    for p in jobs.glob("*.json"):
        try:
            if now - p.stat().st_mtime > RECORD_MAX_AGE_S:
                p.unlink()
        except OSError:
            pass


def fetch_for(ctx: StageContext, load_format: Optional[str] = None) -> str:
    """Materialise the non-weight files of ``ctx.model``; record where and how much on *ctx*."""
    from filelock import FileLock

    from .cache import hold, lock_timeout

    _torch_kernels_dir()
    fmt = load_format or ctx.load_format
    job = _job_id()
    record = _record_path(job, ctx.model) if job else None
    if record is None:
        ctx.local_dir, ctx.stats, _weights, _nonweights = _fetch(ctx, fmt)
        return ctx.local_dir
    start = time.perf_counter()
    with FileLock(str(record) + ".lock", timeout=lock_timeout()):
        try:
            known = json.loads(record.read_text())
        except (OSError, ValueError):
            known = None
        # Hold first, then look: a cleanup may remove an unheld version in between.
        if known and hold(Path(known["local_dir"])) and os.path.isdir(known["local_dir"]):
            _check_recorded(ctx, fmt, known["weights"], known.get("nonweights"))  # ShimError, as a fresh listing would
            ctx.local_dir = known["local_dir"]
            ctx.stats = {**known["stats"], "reused": True, "fetched_files": 0, "fetched_bytes": 0,
                         "seconds": time.perf_counter() - start}
            logger.debug("ray-runai-shim: %s: reusing this job's snapshot %s", ctx.model, ctx.local_dir)
            return ctx.local_dir
        local_dir, stats, weights, nonweights = _fetch(ctx, fmt)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"local_dir": local_dir, "stats": stats, "uri": ctx.model, "weights": weights,
                                   "nonweights": nonweights}))
        os.replace(tmp, record)
        _prune(record.parent)
    ctx.local_dir, ctx.stats = local_dir, stats
    return local_dir
