"""What vLLM is handed: a local non-weight dir as ``model`` plus the weights URI.

Pure: :func:`plan_handoff` returns the new engine kwargs, the environment the
streamer needs and, for vLLM < 0.14, the (dir, URI) pair the config route
injects; the wrapper that calls it applies them. No environment writes and
no wrapping happen here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from ..context import StageContext
from ..tables import settings
from ..tables.support import split_anonymous

MODEL_WEIGHTS = "model_weights"
CONFIG = "config"


class Handoff(NamedTuple):
    kwargs: dict[str, Any]  # vLLM's engine kwargs
    env: dict[str, str]  # set-if-absent in this process (the engine core inherits it)
    inject: Optional[tuple[str, str]]  # vLLM < 0.14: (local dir, URI) for ModelConfig.model_weights
    how: str  # for the one INFO line


#: The streamer's switch for unsigned S3 requests (Ray spells it ``anonymous@`` in the URI).
UNSIGNED = settings.STREAMER_UNSIGNED


def streamer_uri(uri: str) -> tuple[str, dict[str, str]]:
    """Ray's ``s3://anonymous@bucket/...`` means unsigned access; the streamer spells it
    ``s3://bucket/...`` plus ``RUNAI_STREAMER_S3_UNSIGNED=1``."""
    plain, anonymous = split_anonymous(uri)
    return plain, ({UNSIGNED: "1"} if anonymous else {})


def vllm_takes_model_weights() -> bool:
    """vLLM >= 0.14 has ``EngineArgs.model_weights``; older ones only read it off ModelConfig.

    ``RAY_RUNAI_SHIM_HANDOFF=config`` forces the older route (for vLLM builds whose
    field exists but misbehaves); ``=model_weights`` forces the field.
    """
    forced = settings.choice(settings.HANDOFF, ("auto", MODEL_WEIGHTS, CONFIG), "auto")
    if forced != "auto":
        return forced == MODEL_WEIGHTS
    from vllm.engine import arg_utils

    return any(f.name == MODEL_WEIGHTS for f in dataclasses.fields(arg_utils.EngineArgs))


def plan_handoff(ctx: StageContext, kwargs: dict[str, Any], local_dir: str, takes_model_weights: bool) -> Handoff:
    """*kwargs* (which already point vLLM at *local_dir*) plus the weights from ``ctx.model``."""
    weights_uri, env = streamer_uri(ctx.model)
    new = dict(kwargs)
    new.setdefault("served_model_name", ctx.model)
    inject = None
    if ctx.load_format == "tensorizer":
        extra = dict(new.get("model_loader_extra_config") or {})
        extra.setdefault("tensorizer_uri", f"{weights_uri.rstrip('/')}/model.tensors")
        new["model_loader_extra_config"] = extra
        how = f"tensorizer_uri={extra['tensorizer_uri']}"
    elif takes_model_weights:
        new.setdefault(MODEL_WEIGHTS, weights_uri)
        how = MODEL_WEIGHTS
    else:
        inject = (local_dir, weights_uri)
        how = "model_config.model_weights"
    return Handoff(new, env, inject, how)
