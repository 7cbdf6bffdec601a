"""vLLM 0.11-0.15: engines starting together on one node race on vLLM's own pull.

From Ray 2.51 (Ray Data) and 2.52 (Serve LLM) Ray hands vLLM the object-store
URI and vLLM pulls the config/tokenizer files itself, into
``$VLLM_ASSETS_CACHE/model_streamer/<sha256(uri)[:8]>``. On vLLM 0.11-0.15
``ObjectStorageModel.__init__`` wipes and re-creates that directory for every
engine config (``rmtree`` then ``makedirs``), so two engines of one model
starting together on a node (Ray Data ``concurrency>1``, several Serve
replicas) fail with ``FileExistsError`` or read files the other just deleted
(ray#60681; fixed in vLLM 0.16 by vllm#33604). The target is limited to those
vLLM releases (:data:`.support.VLLM_AUX_PULL_RACE`).

This wrapper, on ``EngineArgs.create_engine_config``, does what the shim does
on Ray 2.45-2.50: the locked, content-checked, node-shared non-weight fetch
(:func:`.nonweights.fetch_for`) and the handoff (:mod:`.handoff`): vLLM gets
that directory as ``model`` plus the weights URI, so it never pulls. vLLM
0.11-0.13 have no ``EngineArgs.model_weights`` and Ray builds the config twice
from one args object, so a directory handed off here gets the URI on every
config built from it in this process.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..failopen import NotApplicable, fail_open
from ..snapshot.handoff import MODEL_WEIGHTS
from .decide import apply_handoff, streaming_request

_lock = threading.Lock()
#: local dir -> weights URI, for the configs vLLM < 0.14 builds again from handed-off args.
_handed: dict[str, str] = {}


def _inject(config: Any, uri: str) -> Any:
    object.__setattr__(config.model_config, MODEL_WEIGHTS, uri)
    return config


@fail_open("the locked non-weight fetch",
           fallback="vLLM pulls the non-weight files itself (engines starting together on this node may race: "
                    "ray#60681)")
def create_engine_config(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    model = getattr(instance, "model", None)
    with _lock:
        uri = _handed.get(model) if isinstance(model, str) else None
    if uri is not None and not getattr(instance, MODEL_WEIGHTS, None):
        return _inject(original(*args, **kwargs), uri)  # a config rebuilt from handed-off args (vLLM < 0.14)
    ctx = streaming_request(model, {"load_format": getattr(instance, "load_format", None),
                                    "hf_config_path": getattr(instance, "hf_config_path", None)})
    if ctx is None:
        raise NotApplicable("not a streaming load_format with an object-store model")
    if getattr(instance, MODEL_WEIGHTS, None):
        raise NotApplicable("model_weights is set: vLLM does not pull")
    tokenizer = getattr(instance, "tokenizer", None)
    if tokenizer not in (None, "", model):
        raise NotApplicable("a tokenizer from another source (vLLM pulls it)")
    from ..snapshot.nonweights import fetch_for
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)  # ShimError: before anything is fetched
    local_dir = fetch_for(ctx)
    h = apply_handoff(ctx, {"model": local_dir, "tokenizer": local_dir}, local_dir)
    # Nothing can fail from here on: vLLM's args change only now.
    for key, value in h.kwargs.items():
        if key == "served_model_name" and getattr(instance, key, None):
            continue  # the user's own name stays
        setattr(instance, key, value)
    if h.inject is None:
        return original(*args, **kwargs)
    with _lock:
        _handed[local_dir] = h.inject[1]
    return _inject(original(*args, **kwargs), h.inject[1])
