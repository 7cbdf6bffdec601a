"""vLLM's workers on other nodes: the non-weight files where the engine said they are.

vLLM builds its config on one node. There ``model`` is a local directory (the
shim's snapshot, or from Ray 2.51 on vLLM's own pull dir
``model_streamer/<hash>``) and ``model_weights`` the object-store URI. With
tensor or pipeline parallelism across nodes (vLLM's Ray executor) the workers
on the other nodes get that config, and the directory does not exist there
(vllm#50616, KAITO#2320). A text-only model reads nothing from it in a worker;
remote-code models (``auto_map``), the Transformers backend and multimodal
processors do, and fail on those nodes only.

:func:`init_worker` wraps ``WorkerWrapperBase.init_worker``, the first worker
code that sees the config. When the directory is missing on this node and the
weights stream from an object store, it runs the shim's locked,
content-checked non-weight fetch (:func:`.nonweights.fetch_for`) here. When
that snapshot lives at another path (another cache root, or vLLM's pull dir),
this worker's own unpickled copy of the config is pointed at it.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Callable, Optional

from ..failopen import NotApplicable, fail_open
from ..log import logger
from ..redact import shown_uri
from ..snapshot.handoff import UNSIGNED
from ..tables.support import join_anonymous, normalize_load_format
from .decide import streaming_request


def _worker_config(instance: Any, args: tuple, kwargs: dict) -> Any:
    all_kwargs = args[0] if args else kwargs.get("all_kwargs")
    rank = getattr(instance, "rpc_rank", 0)
    try:
        return all_kwargs[rank].get("vllm_config")
    except (TypeError, IndexError, KeyError, AttributeError):
        return None


def weights_source(model_config: Any, load_config: Any) -> tuple[Optional[str], Optional[str]]:
    """(object-store URI of the model, load format) as vLLM's config holds them.

    The URI is ``model_weights`` (tensorizer: the directory of ``tensorizer_uri``);
    an unsigned streamer (``RUNAI_STREAMER_S3_UNSIGNED=1``) reads it as Ray's
    ``s3://anonymous@`` form, so the fetch is unsigned too.
    """
    load_format = normalize_load_format(getattr(load_config, "load_format", None))
    if load_format == "tensorizer":
        extra = getattr(load_config, "model_loader_extra_config", None) or {}
        tensors = extra.get("tensorizer_uri") if isinstance(extra, dict) else None
        uri = posixpath.dirname(tensors) if isinstance(tensors, str) else None
    else:
        uri = getattr(model_config, "model_weights", None) or None
    if isinstance(uri, str) and os.environ.get(UNSIGNED) == "1":
        uri = join_anonymous(uri)
    return uri, load_format


def missing_local_dir(model_config: Any) -> Optional[str]:
    """``model_config.model`` when it is an absolute local path that does not exist here."""
    model = getattr(model_config, "model", None)
    if isinstance(model, str) and "://" not in model and os.path.isabs(model) and not os.path.isdir(model):
        return model
    return None


def _point_at(model_config: Any, told: str, local: str) -> None:
    for name in ("model", "tokenizer"):
        if getattr(model_config, name, None) == told:
            object.__setattr__(model_config, name, local)


@fail_open("fetching the non-weight files on this worker's node",
           fallback="vLLM's worker starts without them (a model that reads them here, e.g. remote code, fails)")
def init_worker(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    config = _worker_config(instance, args, kwargs)
    model_config = getattr(config, "model_config", None)
    told = missing_local_dir(model_config)
    if told is None:
        raise NotApplicable("the model directory is on this node (or not a local path)")
    uri, load_format = weights_source(model_config, getattr(config, "load_config", None))
    ctx = streaming_request(uri, {"load_format": load_format})
    if ctx is None:
        raise NotApplicable("the weights do not stream from an object store")
    from ..snapshot.nonweights import fetch_for

    local = fetch_for(ctx)  # ShimError (no such bucket, denied...) reaches the user here
    if os.path.realpath(local) != os.path.realpath(told):
        _point_at(model_config, told, local)
    rank = getattr(instance, "global_rank", getattr(instance, "rpc_rank", 0))
    logger.info("ray-runai-shim: %s was not on this node (rank %s): fetched the non-weight files of %s to %s "
                "(%s files, %s bytes)", told, rank, shown_uri(ctx.model), local,
                ctx.stats.get("fetched_files"), ctx.stats.get("fetched_bytes"))
    return original(*args, **kwargs)
