"""Ray Serve LLM 2.52-2.58: give vLLM the mirror's URI, not the bare ``model_id``.

From 2.52 Serve skips its node-init download for a streaming ``load_format``,
but ``VLLMEngineConfig.get_initialization_kwargs`` still sets
``model=actual_hf_model_id``. For a ``CloudMirrorConfig`` source that is the
``model_id`` alias (``hf_model_id`` is None), and from 2.57 a string URI is
turned into such a mirror too (ray#64110), so every remote source is affected
(ray#64978, ray#65477). vLLM then looks ``"my-model"`` up on the Hugging Face
hub and the replica dies. Ray 2.59 fixes it in ``_get_vllm_engine_config``
(ray#65753: ``hf_model_id = mirror_config.bucket_uri`` for streaming formats);
this step (of :mod:`.serve_engine_kwargs`) does the same, one step later, on the releases
without the fix.

Only the exact broken case changes: a mirror with a remote bucket URI, a
streaming format, and ``model`` still equal to the alias (Ray found no local
copy). Anything else -- a local path Ray resolved, a Hugging Face id given as
``model_source`` -- is left alone.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..failopen import NotApplicable, step
from ..log import logger
from ..redact import redact_url
from ..tables.support import is_remote_uri, is_streaming_format, normalize_load_format
from .decide import mirror_uri

_announced: set[tuple[str, str]] = set()


@step("the Serve mirror-URI fix", fallback="vLLM gets the bare model_id and the replica fails to start")
def mirror_for_alias(instance: Any, result: dict) -> Optional[dict]:
    """``model=<mirror bucket URI>`` where Ray would hand vLLM the ``model_id`` alias."""
    uri = mirror_uri(getattr(instance, "mirror_config", None))
    load_format = normalize_load_format((instance.engine_kwargs or {}).get("load_format"))
    alias = result.get("model")
    if not (uri and is_remote_uri(uri) and is_streaming_format(load_format)):
        raise NotApplicable("not a streaming mirror source")
    if alias != instance.actual_hf_model_id or is_remote_uri(alias) or os.path.isdir(str(alias)):
        raise NotApplicable("Ray already gives vLLM a path or a URI")
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(uri, load_format)  # ShimError, not a hub lookup of the alias
    key = (str(alias), uri)
    if key not in _announced:
        _announced.add(key)
        logger.info(
            "ray-runai-shim: Serve LLM would hand vLLM the bare model_id %r for a streaming source "
            "(ray#64978, fixed in Ray 2.59); vLLM streams from %s with load_format=%s instead",
            alias, redact_url(uri), load_format,
        )
    return {**result, "model": uri}
