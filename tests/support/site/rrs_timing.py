"""Cold-start timing hooks for ``bench/bench_coldstart.py`` (bench-only, not the shim).

``RAY_RUNAI_SHIM_BENCH_TIMING=/path/file.jsonl`` appends one JSON line per event,
with wall-clock ``time.time()`` stamps so the driver can line them up:

* ``download``: the vLLM stage's ``download_model_files`` call, start to end, in the
  stage actor. Wrapped when the stage UDF is constructed, not at import, so the
  timer is the outermost wrapper: on a shimmed Ray it times the shim's fetch, on
  Ray alone Ray's full copy, on Ray 2.60 Ray's own narrowed download.
* ``load``: vLLM's ``BaseModelLoader.load_model`` (model init + weight load), in
  whichever process builds the model (vLLM's Worker or EngineCore), with the peak RSS
  (``VmHWM``) of that process and of its parents up to Ray's stage actor. vLLM's CPU build logs no load
  time for ``runai_streamer``, so the benchmark needs its own.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rrs_engine_recorder import _append_jsonl
from rrs_flags import ENV_BENCH_TIMING

STAGE = "ray.llm._internal.batch.stages.vllm_engine_stage"
LOADER = "vllm.model_executor.model_loader.base_loader"


def enabled() -> bool:
    return bool(os.environ.get(ENV_BENCH_TIMING))


def peak_rss_kib(pid: int) -> int | None:
    """``VmHWM`` of *pid* in KiB (None if the process is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def ancestors(depth: int = 4) -> list[dict[str, Any]]:
    """The loading process's parents (vLLM's Worker -> EngineCore -> Ray's stage actor), with peak RSS."""
    out, pid = [], os.getppid()
    while pid > 1 and len(out) < depth:
        out.append({"pid": pid, "cmdline": _cmdline(pid), "peak_rss_kib": peak_rss_kib(pid)})
        pid = _ppid(pid)
    return out


def install(wrapt: Any) -> None:
    path = os.environ[ENV_BENCH_TIMING]

    def record(event: str, start: float, **extra: Any) -> None:
        _append_jsonl(path, {"event": event, "pid": os.getpid(), "start": start, "end": time.time(), **extra})

    def timed_download(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        start = time.time()
        try:
            return wrapped(*args, **kwargs)
        finally:
            record("download", start)

    def udf_init(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        import sys

        module = sys.modules[STAGE]
        if not getattr(module, "_rrs_bench_timed", False):
            module.download_model_files = wrapt.FunctionWrapper(module.download_model_files, timed_download)
            module._rrs_bench_timed = True
        return wrapped(*args, **kwargs)

    def stage_hook(module: Any) -> None:
        wrapt.wrap_function_wrapper(module, "vLLMEngineStageUDF.__init__", udf_init)

    def load_model(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        start = time.time()
        try:
            return wrapped(*args, **kwargs)
        finally:
            record(
                "load",
                start,
                loader=type(_instance).__name__,
                peak_rss_kib=peak_rss_kib(os.getpid()),
                ancestors=ancestors(),
            )

    def loader_hook(module: Any) -> None:
        wrapt.wrap_function_wrapper(module, "BaseModelLoader.load_model", load_model)

    wrapt.register_post_import_hook(stage_hook, STAGE)
    wrapt.register_post_import_hook(loader_hook, LOADER)
