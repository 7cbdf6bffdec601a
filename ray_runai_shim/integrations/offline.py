"""vLLM 0.10.2-0.22 under ``HF_HUB_OFFLINE=1``: an object-store model becomes a Hub lookup.

With ``HF_HUB_OFFLINE`` set, those releases' ``EngineArgs.__post_init__`` replace
``model`` (and, from 0.12, a given ``tokenizer``) by ``get_model_path(...)``, which
returns a path that exists and otherwise asks the Hub's cache:
``snapshot_download(repo_id=model, local_files_only=True)``. An ``s3://``/``gs://``
URI is no repo id, so the Hub's validator raises ``HFValidationError`` ("Repo id
must be in the form 'repo_name' or 'namespace/repo_name': 's3://...'") while the
arguments are built -- in Ray's stage actor or Serve replica, before the shim's
other wrappers (on ``create_engine_config``) or vLLM's own pull run. An offline
cluster cannot stream at all. vLLM 0.23 skips ``is_cloud_storage`` URIs there;
``ModelConfig`` then pulls the non-weight files from the store as usual.

This wrapper, on the name ``vllm.engine.arg_utils.get_model_path`` (the function
``__post_init__`` calls; the same function lives in ``transformers_utils``), does
what 0.23 does: an object-store URI comes back unchanged, anything else goes to
vLLM's own lookup. The target is limited to those vLLM releases
(:data:`.support.VLLM_OFFLINE_HUB_LOOKUP`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..failopen import NotApplicable, fail_open
from ..log import logger
from ..tables.support import is_object_store_uri
from .decide import bind


@fail_open("keeping the object-store URI out of vLLM's offline Hub lookup",
           fallback="vLLM looks the URI up on the Hugging Face Hub (HFValidationError under HF_HUB_OFFLINE=1)")
def get_model_path(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    model = bind(original, args, kwargs).get("model")
    if not is_object_store_uri(model):
        raise NotApplicable("not an object-store URI (vLLM's Hub cache lookup runs)")
    logger.debug("ray-runai-shim: HF_HUB_OFFLINE=1: %s stays an object-store URI (no Hub lookup)", model)
    return model
