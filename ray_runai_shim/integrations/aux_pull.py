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

This step of the engine-config hook (:mod:`.engine_config`) does what the shim
does on Ray 2.45-2.50: the locked, content-checked, node-shared non-weight fetch
(:func:`.nonweights.fetch_for`) and the handoff (:func:`.decide.apply_handoff`):
vLLM gets that directory as ``model`` plus the weights URI, so it never pulls.
vLLM 0.11-0.13 have no ``EngineArgs.model_weights``: the hook's
:func:`.vllm_args.inject_weights` sets the URI on every config built from that
directory, Ray's second build from the same args included.
"""

from __future__ import annotations

from typing import Any

from ..failopen import NotApplicable, step
from ..snapshot.handoff import MODEL_WEIGHTS
from .decide import apply_handoff, streaming_request


@step("the locked non-weight fetch",
      fallback="vLLM pulls the non-weight files itself (engines starting together on this node may race: ray#60681)")
def hand_off(instance: Any) -> None:
    """Fetch the non-weight files (locked, node-shared) and point vLLM's args at them."""
    model = getattr(instance, "model", None)
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
