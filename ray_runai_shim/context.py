"""The per-stage state that links the UDF constructor, the download and the handoff.

``vLLMEngineStageUDF.__init__`` is the only frame that sees ``engine_kwargs``;
the download function and the engine wrapper it calls do not. A ContextVar
set for the duration of that constructor carries ``load_format`` down to them
without touching any Ray signature, and is gone (reset) when it returns, so
other stages' downloads in the same process are never affected.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class StageContext:
    model: str
    load_format: str
    engine_kwargs: dict[str, Any]
    #: Set by the narrowed download: the local non-weight directory.
    local_dir: Optional[str] = None
    #: True once the shim fell back to Ray's own behaviour for this stage.
    fell_back: bool = False
    stats: dict[str, Any] = field(default_factory=dict)


current_stage: contextvars.ContextVar[Optional[StageContext]] = contextvars.ContextVar(
    "ray_runai_shim_stage", default=None
)

#: Set while vLLMEngineWrapper builds its engine on vLLM < 0.14, where the
#: weights URI is injected into every VllmConfig the args produce.
current_weights: contextvars.ContextVar[Optional[tuple[str, str]]] = contextvars.ContextVar(
    "ray_runai_shim_weights", default=None
)
