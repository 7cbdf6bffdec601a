"""Serve LLM's ``VLLMEngineConfig.get_initialization_kwargs``: the one hook, and its steps in order.

Where every Serve LLM release builds the keyword arguments of vLLM's engine. Ray's own method
runs once; then, each where the version tables switched it on (:func:`.registry.patches_on`):

1. :func:`.serve.hand_off` (2.45-2.51) -- ``model`` is the non-weight dir the shim fetched,
   plus the weights URI;
2. :func:`.serve_mirror.mirror_for_alias` (2.52-2.58) -- the mirror's URI instead of the bare
   ``model_id`` alias (ray#64978).

No release needs both (the first leaves no alias behind), but the order is the one that would
hold if one did: a dir the shim fetched is never replaced by the URI.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import registry
from ..failopen import fail_open
from ..tables.support import SERVE_HANDOFF, SERVE_MIRROR
from ..tables.targets import ENGINES_VLLM_MODELS, VLLM_MODELS
from . import serve, serve_mirror

#: The names this hook is installed on (Serve moved the class in 2.51).
NAMES = tuple(f"{m}.VLLMEngineConfig.get_initialization_kwargs" for m in (VLLM_MODELS, ENGINES_VLLM_MODELS))


@fail_open("Serve's vLLM engine kwargs", fallback="vLLM gets Ray's arguments")
def init_kwargs(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> dict:
    on = registry.patches_on(*NAMES)
    result = original(*args, **kwargs)
    if SERVE_HANDOFF in on:
        result = serve.hand_off(instance, result) or result
    if SERVE_MIRROR in on:
        result = serve_mirror.mirror_for_alias(instance, result) or result
    return result
