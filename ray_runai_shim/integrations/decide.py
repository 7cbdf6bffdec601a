"""The one classifier every wrapper asks (botocore's ``_determine_call_context``).

Two questions, answered from plain values, never by side effect:

* :func:`streaming_request` -- does this engine stream its weights from an
  object store? (a streaming ``load_format`` and an ``s3://``/``gs://`` source)
* :func:`download_kind` -- what is this ``download_model_files`` call: the
  full model download the shim replaces, a tokenizer-only one, or other?

and the one step that acts on the answer, :func:`apply_handoff`, with the one record of
what it handed over for vLLM < 0.14 (:func:`handed_weights`).
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any, Callable, Optional

from ..context import StageContext
from ..log import log_handoff
from ..snapshot.handoff import Handoff, plan_handoff, vllm_takes_model_weights
from ..tables.support import is_remote_uri, is_streaming_format, normalize_load_format

_SIGNATURES: dict[Any, inspect.Signature] = {}


def bind(fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by parameter name (defaults applied), whatever way they were passed."""
    fn = getattr(fn, "__wrapped__", fn)  # fail_open's ``original`` carries Ray's callable
    key = getattr(fn, "__func__", fn)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(fn)
    bound = sig.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


FULL = "full"  # MODEL_AND_TOKENIZER: what streaming replaces by the non-weight fetch
TOKENIZER_ONLY = "tokenizer"
OTHER = "other"


def streaming_request(model: Any, engine_kwargs: Optional[dict[str, Any]]) -> Optional[StageContext]:
    """A fresh stage context when *model* streams from an object store, else None."""
    engine_kwargs = dict(engine_kwargs or {})
    load_format = normalize_load_format(engine_kwargs.get("load_format"))
    if not (is_streaming_format(load_format) and is_remote_uri(model)):
        return None
    return StageContext(model=model, load_format=load_format, engine_kwargs=engine_kwargs)


def mirror_uri(mirror: Any) -> Optional[str]:
    """A ``CloudMirrorConfig``'s bucket URI (None for no mirror)."""
    return getattr(mirror, "bucket_uri", None) if mirror is not None else None


def download_kind(params: dict[str, Any], model: Optional[str] = None, mirror: Optional[str] = None) -> str:
    """Classify a bound ``download_model_files`` call for source *model* (+ *mirror*).

    Only a download of exactly that source counts; with ``model=None`` any
    remote source does (the tokenizer stages know no engine).
    """
    mode = getattr(params.get("download_model"), "name", None)
    model_id = params.get("model_id")
    if model is not None and (model_id != model or mirror_uri(params.get("mirror_config")) != mirror):
        return OTHER
    source = mirror_uri(params.get("mirror_config")) or model_id
    if not is_remote_uri(source):
        return OTHER
    if mode == "MODEL_AND_TOKENIZER":
        return FULL
    if mode == "TOKENIZER_ONLY":
        return TOKENIZER_ONLY
    return OTHER


_lock = threading.Lock()
#: local non-weight dir -> the weights URI handed with it, where vLLM (< 0.14) reads the URI off
#: the config it builds: the only state a handoff leaves, read by :func:`handed_weights`.
_handed: dict[str, str] = {}


def apply_handoff(ctx: StageContext, kwargs: dict[str, Any], local_dir: str) -> Handoff:
    """The one handoff every front-end applies: plan what vLLM is handed (the local non-weight
    dir and the weights URI, :func:`..snapshot.handoff.plan_handoff`), export the streamer's
    settings (set-if-absent: the user's win), say it once, and, for vLLM < 0.14, remember the
    URI for that dir (the engine-config hook sets it on every config built from the dir). The
    caller puts ``h.kwargs`` where its consumer reads them (a call's kwargs, Serve's dict,
    vLLM's args)."""
    takes = ctx.load_format == "tensorizer" or vllm_takes_model_weights()
    h = plan_handoff(ctx, kwargs, local_dir, takes)
    for key, value in h.env.items():
        os.environ.setdefault(key, value)
    if h.inject is not None:
        with _lock:
            _handed[h.inject[0]] = h.inject[1]
    log_handoff(ctx.model, ctx.load_format, local_dir, h.how, ctx.stats)
    return h


def handed_weights(model: Any) -> Optional[str]:
    """The weights URI a handoff gave with the local dir *model* (vLLM < 0.14's route), or None.
    Keyed by the dir, not by a context: Ray builds the config twice from one args object, the
    second time after the frame that handed it off has returned."""
    with _lock:
        return _handed.get(model) if isinstance(model, str) else None
