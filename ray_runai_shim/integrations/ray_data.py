"""Ray Data's vLLM stage on Ray 2.45-2.50: three thin wrappers around one context.

``vLLMEngineStageUDF.__init__`` is the only frame that sees ``engine_kwargs``.
:func:`udf_init` opens a :class:`.StageContext` for its duration when the
engine streams from an object store; inside it, :func:`download` replaces the
stage's full download by the non-weight fetch, and :func:`engine_init` hands
vLLM that directory plus the weights URI (:mod:`.handoff`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..context import current_stage
from ..failopen import NotApplicable, fail_open
from ..snapshot.nonweights import fetch_for
from ..stores.azure import warn_if_azure
from ..tables.support import is_remote_uri
from .decide import FULL, apply_handoff, bind, download_kind, streaming_request


def _mark_fell_back() -> None:
    ctx = current_stage.get()
    if ctx is not None:
        ctx.fell_back = True


@fail_open("reading the vLLM stage's arguments", fallback="the stage runs as Ray wrote it (Ray copies the model)")
def udf_init(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    params = bind(original, args, kwargs)
    ctx = streaming_request(params.get("model"), params.get("engine_kwargs"))
    if ctx is None:
        warn_if_azure(params.get("model"), params.get("engine_kwargs"))
        raise NotApplicable("not a streaming format with an object-store source")
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)  # ShimError: fail before any download
    token = current_stage.set(ctx)
    try:
        return original(*args, **kwargs)
    finally:
        current_stage.reset(token)


@fail_open(
    "the narrowed download",
    fallback="Ray's own download runs instead and copies the whole model, weights included",
    on_fallback=_mark_fell_back,
)
def download(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The stage's MODEL_AND_TOKENIZER download of its own source becomes the non-weight fetch."""
    ctx = current_stage.get()
    if ctx is None or ctx.fell_back:
        raise NotApplicable("outside a streaming vLLM stage")
    if download_kind(bind(original, args, kwargs), ctx.model) != FULL:
        raise NotApplicable("not the stage's full download (Ray narrows it itself, or another source)")
    return fetch_for(ctx)


@fail_open("the weights handoff", fallback="vLLM gets Ray's arguments")
def engine_init(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``vLLMEngineWrapper(model=<uri>, model_source=<local dir>, ...)``: add the weights URI."""
    ctx = current_stage.get()
    local_dir = kwargs.get("model_source")
    if (
        ctx is None
        or ctx.fell_back
        or not isinstance(local_dir, str)
        or is_remote_uri(local_dir)
        or not os.path.isdir(local_dir)
    ):
        raise NotApplicable("no local non-weight dir for a streaming stage")
    return original(*args, **apply_handoff(ctx, kwargs, local_dir).kwargs)
