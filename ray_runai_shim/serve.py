"""Ray Serve LLM on Ray 2.45-2.51: the same narrowed download and handoff as the batch stage.

Serve's node initialisation (``_initialize_local_node``, inside the replica)
calls ``download_model_files(..., MODEL_AND_TOKENIZER)`` for a string URI and
for a ``CloudMirrorConfig`` source alike, sets ``hf_model_id`` to the local
copy, preloads the tokenizer from it, and hands that copy to vLLM -- whatever
``engine_kwargs["load_format"]`` says. The shim keeps Ray's flow and changes
two things:

1. **Download.** While ``_initialize_local_node`` runs for a streaming format
   and a remote source, the node-init module's ``download_model_files`` fetches
   only the non-weight files (:func:`.patches.narrowed_fetch`) and returns that
   directory. Ray then sets ``hf_model_id`` to it, so the tokenizer preload and
   ``apply_checkpoint_info`` read real local files. Mirror ``extra_files`` are
   still fetched by Ray (``download_model=NONE``).
2. **Handoff.** ``VLLMEngineConfig.get_initialization_kwargs`` -- the one place
   every 2.45-2.50 release builds vLLM's arguments from -- gives vLLM
   ``model=<that dir>`` plus the weights URI (:func:`.patches._handoff_kwargs`).
   It recognises the directory by the manifest the fetch wrote, so it also works
   where Ray builds the engine config in a separate ``ray.remote`` task (GPU
   deployments), as long as the shim is loaded there (job-level setup hook).

``_initialize_local_node`` runs its body in an executor thread, where a
ContextVar set by the caller is not visible; a small lock-guarded map keyed by
(model id, mirror URI) carries the decision across, for exactly that call.

Ray 2.51 moved the download into ``initialize_remote_node``, a ``ray.remote`` task
per placement-group node; its ``download_model_files`` call carries a ``callback``
holding the LLMConfig, so the decision is read from there (no arming needed), and
the handoff is the same wrapper on 2.51's ``serve/engines/vllm/vllm_models.py``.

Not covered: pipeline parallelism > 1 on 2.45-2.50 (Ray downloads per node in
``ray.remote`` tasks whose result it ignores; the shim leaves them alone), and
2.52+ (see ``support.SERVE_RANGES``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from .context import StageContext, current_weights
from .log import logger
from .patches import (
    _bind,
    _handoff_kwargs,
    _log_stage,
    _wants,
    _wrap,
    narrowed_fetch,
)
from .support import (
    ACTIVATION,
    SERVE_DOWNLOAD,
    SERVE_HANDOFF,
    SERVE_RANGES,
    Plan,
    is_remote_uri,
    is_streaming_format,
    normalize_load_format,
    plan_for,
)

NODE_INIT = "ray.llm._internal.serve.deployments.utils.node_initialization_utils"
VLLM_MODELS = "ray.llm._internal.serve.deployments.llm.vllm.vllm_models"
REMOTE_NODE_INIT = "ray.llm._internal.serve.utils.node_initialization_utils"
ENGINES_VLLM_MODELS = "ray.llm._internal.serve.engines.vllm.vllm_models"
VLLM_ARG_UTILS = "vllm.engine.arg_utils"
RUNTIME_ENV = "vllm-runtime-env"  # patch name: keep vLLM's ray.init working under the setup hook

_lock = threading.Lock()
#: (model id as Ray passes it, mirror bucket URI or None) -> the streaming decision.
_armed: dict[tuple[Optional[str], Optional[str]], StageContext] = {}
#: local dir -> the context that fetched it (for the one INFO line with sizes).
_fetched: dict[str, StageContext] = {}


def serve_plan() -> Optional[Plan]:
    version = getattr(sys.modules.get("ray"), "__version__", None)
    return plan_for(version, SERVE_RANGES) if version else None


def _serve_wants(patch: str) -> bool:
    plan = serve_plan()
    return plan is not None and patch in plan.patches


# --------------------------------------------------------------------------- decisions


def _engine_config_of(target: Any) -> Any:
    """2.45-2.48 pass the VLLMEngineConfig, 2.49-2.50 the LLMConfig."""
    get = getattr(target, "get_engine_config", None)
    return get() if callable(get) else target


def _bucket(mirror: Any) -> Optional[str]:
    return getattr(mirror, "bucket_uri", None) if mirror is not None else None


def _mirror_uri(engine_config: Any) -> Optional[str]:
    return _bucket(getattr(engine_config, "mirror_config", None))


def _load_format(engine_config: Any) -> Optional[str]:
    return normalize_load_format((getattr(engine_config, "engine_kwargs", None) or {}).get("load_format"))


def streaming_source(engine_config: Any) -> Optional[StageContext]:
    """A context when this engine streams from an object store (string URI or mirror)."""
    load_format = _load_format(engine_config)
    if not is_streaming_format(load_format):
        return None
    mirror = getattr(engine_config, "mirror_config", None)
    uri = _mirror_uri(engine_config) if mirror is not None else engine_config.actual_hf_model_id
    if not is_remote_uri(uri):
        return None
    return StageContext(model=uri, load_format=load_format, engine_kwargs=dict(engine_config.engine_kwargs))


def snapshot_source(path: Any) -> Optional[str]:
    """The URI a shim snapshot dir was fetched from (its manifest), else None."""
    from .fetch import MANIFEST

    if not isinstance(path, str) or is_remote_uri(path):
        return None
    p = Path(path)
    if p.parent.name != "ray-runai-shim":
        return None
    try:
        return json.loads((p / MANIFEST).read_text()).get("source") or None
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- download


def _local_node(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Arm the narrowed download for this ``_initialize_local_node`` call."""
    key = ctx = None
    try:
        target = args[0] if args else kwargs.get("engine_config", kwargs.get("llm_config"))
        engine_config = _engine_config_of(target)
        mode = getattr(kwargs.get("download_model"), "name", None)
        ctx = streaming_source(engine_config)
        if ctx is not None and mode == "MODEL_AND_TOKENIZER":
            key = (engine_config.actual_hf_model_id, _mirror_uri(engine_config))
    except Exception:
        logger.warning("ray-runai-shim: cannot read Serve's node-init arguments; leaving Ray as is", exc_info=True)
        key = None
    if key is None or ctx is None:
        return wrapped(*args, **kwargs)
    from .requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)  # ShimError before any download
    with _lock:
        _armed[key] = ctx

    def disarm(*_: Any) -> None:
        with _lock:
            if _armed.get(key) is ctx:
                del _armed[key]

    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        disarm()
        raise
    if hasattr(result, "add_done_callback"):
        result.add_done_callback(disarm)  # the executor thread has run the download by then
    else:
        disarm()
    return result


def _download(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """In the armed call only: the non-weight fetch instead of Ray's full download."""
    with _lock:
        armed = bool(_armed)
    if not armed:
        return wrapped(*args, **kwargs)
    try:
        params = _bind(wrapped, args, kwargs)
        mode = params.get("download_model")
        key = (params.get("model_id"), _bucket(params.get("mirror_config")))
        with _lock:
            ctx = _armed.get(key)
        ours = ctx is not None and not ctx.fell_back and getattr(mode, "name", None) == "MODEL_AND_TOKENIZER"
    except Exception:
        logger.warning("ray-runai-shim: unexpected Serve download call; using Ray's", exc_info=True)
        ours = False
    if not ours:
        return wrapped(*args, **kwargs)
    local_dir = narrowed_fetch(ctx)
    if local_dir is None:
        return wrapped(*args, **kwargs)
    mirror = params.get("mirror_config")
    if params.get("download_extra_files") and getattr(mirror, "extra_files", None):
        # Ray's own extra-files download, without the model.
        wrapped(
            model_id=params.get("model_id"),
            mirror_config=mirror,
            download_model=type(mode).NONE,
            download_extra_files=True,
        )
    with _lock:
        _fetched[local_dir] = ctx
    return local_dir


def _remote_node_download(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Ray 2.51: ``initialize_remote_node`` (a ``ray.remote`` task per node) downloads with
    a ``callback`` whose ``llm_config`` says what the engine will load."""
    try:
        params = _bind(wrapped, args, kwargs)
        llm_config = getattr(params.get("callback"), "llm_config", None)
        engine_config = llm_config.get_engine_config() if llm_config is not None else None
        ctx = streaming_source(engine_config) if engine_config is not None else None
        mode = params.get("download_model")
        ours = (
            ctx is not None
            and getattr(mode, "name", None) == "MODEL_AND_TOKENIZER"
            and params.get("model_id") == engine_config.actual_hf_model_id
            and _bucket(params.get("mirror_config")) == _mirror_uri(engine_config)
        )
    except Exception:
        logger.warning("ray-runai-shim: unexpected Serve download call; using Ray's", exc_info=True)
        ours = False
    if not ours:
        return wrapped(*args, **kwargs)
    from .requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)
    local_dir = narrowed_fetch(ctx)
    if local_dir is None:
        return wrapped(*args, **kwargs)
    # Ray still runs the user's callback hook and fetches mirror extra_files, without the model.
    wrapped(**{**params, "download_model": type(mode).NONE})
    with _lock:
        _fetched[local_dir] = ctx
    return local_dir


# --------------------------------------------------------------------------- handoff


def _init_kwargs(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> dict:
    """vLLM gets the local non-weight dir as ``model`` and the weights URI."""
    result = wrapped(*args, **kwargs)
    try:
        local_dir = instance.actual_hf_model_id
        uri = snapshot_source(local_dir)
        load_format = _load_format(instance)
        if uri is None or not is_streaming_format(load_format) or not os.path.isdir(local_dir):
            return result
        mirror = _mirror_uri(instance)
        if mirror is not None and mirror.rstrip("/") != uri:
            return result  # someone else's snapshot; never guess
        with _lock:
            ctx = _fetched.get(local_dir)
        if ctx is None or ctx.model.rstrip("/") != uri:
            ctx = StageContext(model=uri, load_format=load_format, engine_kwargs=dict(instance.engine_kwargs))
        # 2.45-2.47 put ``model`` in front of these kwargs; a key here wins.
        new, inject, how = _handoff_kwargs(ctx, {**result, "model": local_dir}, local_dir=local_dir)
    except Exception:
        logger.warning("ray-runai-shim: Serve handoff failed; vLLM gets Ray's arguments", exc_info=True)
        return result
    if inject is not None:
        # vLLM < 0.14: Serve builds the config right after this returns, in this
        # context; the match on args.model == local_dir keeps it to this engine.
        current_weights.set(inject)
    _log_stage(ctx, local_dir, how)
    return new


# --------------------------------------------------------------------------- vLLM's Ray runtime_env


def reusable_runtime_env(env: Any) -> Any:
    """*env* as read back from a worker, made valid as ``ray.init(runtime_env=...)`` input.

    With a job-level ``worker_process_setup_hook`` (how the shim reaches actors),
    ``ray.get_runtime_context().runtime_env`` holds both the hook field and Ray's
    reserved ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``. vLLM (ray backend, which
    Serve LLM always uses) captures exactly that and passes it to ``ray.init`` in
    its EngineCore process, where Ray asserts the reserved variable is absent
    (ray#61350). Dropping the variable lets Ray derive it from the field again; a
    field that is not an importable path (a callable hook's bare name) is dropped
    too. Returns None when nothing needs to change.
    """
    from .activation import RAY_HOOK_ENV

    if not isinstance(env, dict):
        return None
    env_vars = env.get("env_vars") or {}
    if RAY_HOOK_ENV not in env_vars:
        return None
    plain = dict(env.to_dict() if hasattr(env, "to_dict") else env)
    plain["env_vars"] = {k: v for k, v in env_vars.items() if k != RAY_HOOK_ENV}
    hook = plain.get("worker_process_setup_hook")
    if not (isinstance(hook, str) and "." in hook):
        plain.pop("worker_process_setup_hook", None)
    return type(env)(**plain) if type(env) is not dict else plain


def _engine_config(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    config = wrapped(*args, **kwargs)
    try:
        parallel = getattr(config, "parallel_config", None)
        fixed = reusable_runtime_env(getattr(parallel, "ray_runtime_env", None))
        if fixed is not None:
            object.__setattr__(parallel, "ray_runtime_env", fixed)
            logger.debug("ray-runai-shim: removed Ray's reserved setup-hook variable from vLLM's ray_runtime_env")
    except Exception:
        logger.warning("ray-runai-shim: could not clean vLLM's ray_runtime_env", exc_info=True)
    return config


# --------------------------------------------------------------------------- hooks


def _on_node_init(mod: ModuleType) -> None:
    if not _serve_wants(SERVE_DOWNLOAD):
        return
    shape_ok = all(callable(getattr(mod, n, None)) for n in ("_initialize_local_node", "download_model_files"))
    if not shape_ok or "STREAMING_LOAD_FORMATS" in vars(mod):
        logger.warning("ray-runai-shim: Serve's node initialisation has an unexpected shape; not patching")
        return
    _wrap(SERVE_DOWNLOAD, mod, "_initialize_local_node", _local_node)
    _wrap(SERVE_DOWNLOAD, mod, "download_model_files", _download)


def _on_remote_node_init(mod: ModuleType) -> None:
    if not _serve_wants(SERVE_DOWNLOAD):
        return
    if not callable(getattr(mod, "initialize_remote_node", None)) or not callable(
        getattr(mod, "download_model_files", None)
    ):
        logger.warning("ray-runai-shim: Serve's node initialisation has an unexpected shape; not patching")
        return
    # Not initialize_remote_node itself: Ray pickles it into ray.remote by reference.
    _wrap(SERVE_DOWNLOAD, mod, "download_model_files", _remote_node_download)


def _on_vllm_models(mod: ModuleType) -> None:
    if not _serve_wants(SERVE_HANDOFF):
        return
    cls = getattr(mod, "VLLMEngineConfig", None)
    if cls is None or "get_initialization_kwargs" not in vars(cls):
        logger.warning("ray-runai-shim: Serve's VLLMEngineConfig has an unexpected shape; not patching")
        return
    _wrap(SERVE_HANDOFF, cls, "get_initialization_kwargs", _init_kwargs)


def _on_vllm_arg_utils(mod: ModuleType) -> None:
    if not _wants(ACTIVATION):
        return
    cls = getattr(mod, "EngineArgs", None)
    if cls is not None and callable(getattr(cls, "create_engine_config", None)):
        _wrap(RUNTIME_ENV, cls, "create_engine_config", _engine_config)


HOOKS: tuple[tuple[str, Callable[[ModuleType], None]], ...] = (
    (VLLM_ARG_UTILS, _on_vllm_arg_utils),
    (NODE_INIT, _on_node_init),
    (VLLM_MODELS, _on_vllm_models),
    (REMOTE_NODE_INIT, _on_remote_node_init),  # 2.51
    (ENGINES_VLLM_MODELS, _on_vllm_models),  # 2.51
)
