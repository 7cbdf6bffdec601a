"""Ray's ``s3://anonymous@bucket/...`` for the streamer, on Ray 2.51+ (any vLLM).

Ray spells unsigned S3 access as ``anonymous@`` in the URI, and its own
downloads honour it. From 2.51 Ray hands that URI to vLLM as given (Ray Data's
stage, and Serve LLM's engine config), but neither vLLM nor the Run:ai streamer
knows the form: the streamer takes ``anonymous@bucket`` for the bucket name and
the engine fails before it loads anything. The streamer's own switch is
``RUNAI_STREAMER_S3_UNSIGNED=1``. This step of the engine-config hook
(:mod:`.engine_config`: where vLLM first opens the URI, it pulls the non-weight
files there), gives vLLM the plain URI and sets that switch in the
process, so the engine processes it starts inherit it -- what the 2.45-2.51
handoff already does (:func:`.handoff.streamer_uri`).
"""

from __future__ import annotations

import os
from typing import Any

from ..failopen import NotApplicable, step
from ..log import logger
from ..redact import redact_url
from ..snapshot.handoff import UNSIGNED
from ..tables.support import is_streaming_format, normalize_load_format, split_anonymous


@step("the s3://anonymous@ mapping", fallback="vLLM gets the anonymous@ URI, which the streamer cannot open")
def plain_uri(instance: Any) -> None:
    """Map ``s3://anonymous@b/p`` on ``model``/``model_weights``/``tokenizer`` to ``s3://b/p`` + unsigned."""
    if not is_streaming_format(normalize_load_format(getattr(instance, "load_format", None))):
        raise NotApplicable("not a streaming load_format")
    mapped: dict[str, str] = {}
    for field in ("model", "model_weights", "tokenizer"):
        value = getattr(instance, field, None)
        plain, anonymous = split_anonymous(value) if isinstance(value, str) else (value, False)
        if anonymous:
            mapped[field] = plain
    if not mapped:
        raise NotApplicable("no s3://anonymous@ URI")
    for field, plain in mapped.items():
        setattr(instance, field, plain)
    if os.environ.get(UNSIGNED, "1") != "1":
        logger.warning("ray-runai-shim: %s=%s contradicts the anonymous@ URI; using %s=1",
                       UNSIGNED, os.environ[UNSIGNED], UNSIGNED)
    os.environ[UNSIGNED] = "1"
    logger.info("ray-runai-shim: vLLM streams %s with unsigned requests (%s=1; the URI said anonymous@)",
                redact_url(mapped.get("model") or next(iter(mapped.values()))), UNSIGNED)
