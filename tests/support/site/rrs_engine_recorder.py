"""Record what vLLM's ``EngineArgs.create_engine_config`` actually received (test-only).

``RAY_RUNAI_SHIM_TEST_ENGINE_LOG=/path/file.jsonl`` appends one JSON line per call:
the args, the model dir's listing, and what landed on the resulting config.
``RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG=1`` raises :data:`STOP_MESSAGE` right after
each call, so a test sees the real vLLM config without paying for an engine start.
"""

from __future__ import annotations

import os
from typing import Any

from rrs_flags import ENV_ENGINE_LOG, ENV_STOP_AFTER_CONFIG, flag

STOP_MESSAGE = "RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG: stopped before engine start"


def enabled() -> bool:
    return bool(os.environ.get(ENV_ENGINE_LOG)) or flag(ENV_STOP_AFTER_CONFIG)


def _listing(path: Any) -> list[str] | None:
    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    out: list[str] = []
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), path).replace(os.sep, "/"))
    return sorted(out)


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums -> their value
    return value if value is None or isinstance(value, (str, int, float, bool, list)) else str(value)


def _append_jsonl(path: str, record: dict[str, Any]) -> None:
    import json

    line = (json.dumps(record, default=str, sort_keys=True) + "\n").encode()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one O_APPEND write per record: safe across processes
    finally:
        os.close(fd)


def install(wrapt: Any) -> None:
    log_path = os.environ.get(ENV_ENGINE_LOG) or None
    stop = flag(ENV_STOP_AFTER_CONFIG)

    def create_engine_config(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        # Snapshot the args BEFORE the call: create_engine_config rewrites
        # self.model / self.tokenizer / self.model_weights (e.g. after pulling an
        # s3:// model's configs for runai_streamer).
        record: dict[str, Any] = {
            "event": "create_engine_config",
            "pid": os.getpid(),
            "model": getattr(instance, "model", None),
            "model_weights": getattr(instance, "model_weights", None),
            "tokenizer": getattr(instance, "tokenizer", None),
            "load_format": _plain(getattr(instance, "load_format", None)),
            "served_model_name": _plain(getattr(instance, "served_model_name", None)),
            "model_dir_listing": _listing(getattr(instance, "model", None)),
            "model_loader_extra_config": getattr(instance, "model_loader_extra_config", None),
            "tensor_parallel_size": getattr(instance, "tensor_parallel_size", None),
        }
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            if log_path:
                record["error"] = f"{type(exc).__name__}: {exc}"
                _append_jsonl(log_path, record)
            raise
        model_config = getattr(result, "model_config", None)
        record["model_weights_on_config"] = getattr(model_config, "model_weights", None)
        record["model_on_config"] = getattr(model_config, "model", None)
        record["tokenizer_on_config"] = getattr(model_config, "tokenizer", None)
        record["model_on_config_listing"] = _listing(record["model_on_config"])
        if log_path:
            _append_jsonl(log_path, record)
        if stop:
            raise RuntimeError(STOP_MESSAGE)
        return result

    @wrapt.when_imported("vllm.engine.arg_utils")
    def _arg_utils(mod: Any) -> None:
        wrapt.wrap_function_wrapper(mod, "EngineArgs.create_engine_config", create_engine_config)
