"""Ray's ``s3://anonymous@bucket/...`` for the streamer, on Ray 2.52+ (any vLLM).

Ray spells unsigned S3 access as ``anonymous@`` in the URI, and its own
downloads honour it. From 2.52 Ray hands that URI to vLLM as given (Ray Data's
stage, and Serve LLM's engine config), but neither vLLM nor the Run:ai streamer
knows the form: the streamer takes ``anonymous@bucket`` for the bucket name and
the engine fails before it loads anything. The streamer's own switch is
``RUNAI_STREAMER_S3_UNSIGNED=1``. This wrapper, on vLLM's
``EngineArgs.create_engine_config`` (where vLLM first opens the URI: it pulls the
non-weight files there), gives vLLM the plain URI and sets that switch in the
process, so the engine processes it starts inherit it -- what the 2.45-2.51
handoff already does (:func:`.handoff.streamer_uri`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .failopen import NotApplicable, fail_open
from .handoff import streamer_uri
from .log import logger
from .redact import redact_url
from .support import is_streaming_format, normalize_load_format


@fail_open("the s3://anonymous@ mapping", fallback="vLLM gets the anonymous@ URI, which the streamer cannot open")
def create_engine_config(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Map ``s3://anonymous@b/p`` on ``model``/``model_weights``/``tokenizer`` to ``s3://b/p`` + unsigned."""
    if not is_streaming_format(normalize_load_format(getattr(instance, "load_format", None))):
        raise NotApplicable("not a streaming load_format")
    mapped: dict[str, str] = {}
    env: dict[str, str] = {}
    for field in ("model", "model_weights", "tokenizer"):
        value = getattr(instance, field, None)
        if isinstance(value, str):
            plain, extra = streamer_uri(value)
            if extra:
                mapped[field], env = plain, extra
    if not mapped:
        raise NotApplicable("no s3://anonymous@ URI")
    for field, plain in mapped.items():
        setattr(instance, field, plain)
    for key, value in env.items():
        if os.environ.get(key, value) != value:
            logger.warning("ray-runai-shim: %s=%s contradicts the anonymous@ URI; using %s=%s",
                           key, os.environ[key], key, value)
        os.environ[key] = value
    logger.info("ray-runai-shim: vLLM streams %s with unsigned requests (RUNAI_STREAMER_S3_UNSIGNED=1; "
                "the URI said anonymous@)", redact_url(mapped.get("model") or next(iter(mapped.values()))))
    return original(*args, **kwargs)
