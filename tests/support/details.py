"""The per-layer details a matrix test adds to its verdict (``.matrix/results/vllm-<ver>.json``):
``tests/matrix/vllm_envs.py`` names the file in ``RRS_VLLM_DETAILS``; outside a layer, nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def record(key: str, value: Any) -> None:
    path = os.environ.get("RRS_VLLM_DETAILS")
    if not path:
        return
    target = Path(path)
    data = json.loads(target.read_text()) if target.exists() else {}
    data[key] = value
    target.write_text(json.dumps(data, indent=1, default=str))
