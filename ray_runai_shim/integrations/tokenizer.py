"""Tokenizer-only downloads (chat-template and tokenize stages, the processor's config read).

On Ray 2.45-2.55 (ray#62047) a tokenizer-only download from an object store
keeps only keys containing ``tokenizer`` or ``config.json``, so
``chat_template.jinja``, ``vocab.json`` + ``merges.txt``, ``special_tokens_map.json``,
``added_tokens.json`` and ``*.tiktoken`` never arrive and the chat-template stage
fails on checkpoints saved by current ``transformers``. Ray 2.56-2.60 (ray#62121)
add ``chat_template`` to that filter and still drop all the others: a GPT-2 style
(slow BPE) tokenizer fails to load. The shim answers these calls with its
non-weight snapshot (the one the vLLM stage uses where the shim hands off: one
listing, one fetch per node, one lock, one classifier), which holds every one of
those files.

This applies to every ``load_format``: the stages that call it never see the
engine's format, and the bug breaks non-streaming pipelines just the same.
"""

from __future__ import annotations

from typing import Any, Callable

from ..context import StageContext
from ..failopen import NotApplicable, fail_open
from ..snapshot.nonweights import fetch_for
from .decide import TOKENIZER_ONLY, bind, download_kind


@fail_open(
    "serving a tokenizer-only download from the non-weight snapshot",
    fallback="Ray's tokenizer-only download runs (it drops chat_template.jinja, vocab.json, merges.txt, ...)",
)
def download(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    params = bind(original, args, kwargs)
    if params.get("mirror_config") is not None or download_kind(params) != TOKENIZER_ONLY:
        raise NotApplicable("not a tokenizer-only download of an object-store model")
    ctx = StageContext(model=params["model_id"], load_format="auto", engine_kwargs={})
    return fetch_for(ctx)
