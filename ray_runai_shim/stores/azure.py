"""Azure sources: recognised, explained, never streamed by the shim.

Read from the wheels (#16): Ray reads ``abfss://``/``azure://`` from 2.50 only; vLLM
streams only ``az://container/path`` (vLLM >= 0.18, ``runai-model-streamer[azure]``,
the account from ``AZURE_STORAGE_ACCOUNT_NAME``); the streamer's native reader
connects only to ``https://<account>.blob.core.windows.net``, so no emulator can
stand in for Azure and no translation could be tested. With a streaming format the
shim therefore leaves Ray's behaviour alone and says so (a WARNING in the stage or
replica, and ``doctor``): it never lets such a run copy or fail silently.
"""

from __future__ import annotations

from typing import Any, Optional

from ..log import logger
from ..redact import shown_uri
from ..tables import schemes
from ..tables.support import is_streaming_format, normalize_load_format

AZURE_SCHEMES = tuple(f"{s}://" for s in schemes.AZURE)

_warned: set[str] = set()


def is_azure_uri(model: object) -> bool:
    return schemes.is_azure(model)


def azure_note(model: object, load_format: object) -> Optional[str]:
    """What happens to a streaming request from Azure, or None when *model* is not one."""
    if not (is_azure_uri(model) and is_streaming_format(load_format)):
        return None
    fmt = normalize_load_format(load_format)
    return (
        f"ray-runai-shim: {shown_uri(str(model))} is an Azure source; the shim streams s3:// and gs:// only, so "
        f"load_format={fmt} gets Ray's own behaviour here: depending on the Ray release, Ray copies "
        "the whole model to local disk or hands vLLM a URI it cannot stream. vLLM streams Azure only "
        "as az://<container>/<path> (vLLM >= 0.18 with runai-model-streamer[azure] and "
        "AZURE_STORAGE_ACCOUNT_NAME set on the workers); use that form with a Ray release that "
        "passes it to vLLM, or load_format='auto' to copy the model knowingly."
    )


def warn_if_azure(model: object, engine_kwargs: Optional[dict[str, Any]]) -> None:
    """One WARNING per process and source when a streaming request names an Azure source."""
    note = azure_note(model, (engine_kwargs or {}).get("load_format"))
    if note and str(model) not in _warned:
        _warned.add(str(model))
        logger.warning(note)
