"""The env switches of the test-only site hooks (see ``sitecustomize``), and how they are read.

``rrs_`` (ray-runai-shim) prefixes every module in this dir that is not imported
by name elsewhere: the dir is on every test process's PYTHONPATH, so a plain
name could shadow a real package.
"""

from __future__ import annotations

import os

ENV_COMPAT = "RAY_RUNAI_SHIM_TEST_COMPAT"
ENV_ENGINE_LOG = "RAY_RUNAI_SHIM_TEST_ENGINE_LOG"
ENV_STOP_AFTER_CONFIG = "RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG"
ENV_ENDPOINT_ADAPTER = "RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER"
ENV_SERVE_COMPAT = "RAY_RUNAI_SHIM_TEST_SERVE_COMPAT"
ENV_CPU_RAY = "RAY_RUNAI_SHIM_TEST_CPU_RAY"
ENV_BENCH_TIMING = "RAY_RUNAI_SHIM_BENCH_TIMING"  # bench/bench_coldstart.py


def flag(name: str) -> bool:
    """A boolean env switch: unset, empty, ``0``, ``false`` and ``no`` mean off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
