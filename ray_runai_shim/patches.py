"""Every patch the shim makes, where it is made, and how it is undone.

Patches are applied by wrapt post-import hooks on the modules that *use* the
patched names (Ray's stage module binds ``download_model_files`` by name, so
wrapping the defining module alone changes nothing). Nothing here imports Ray
or vLLM; the hooks run when Ray imports its own modules.

A registry of ``(owner, attribute, original, replacement)`` drives
``uninstall()``, which restores every name exactly, and ``status()``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

import wrapt

from . import activation
from ._bootstrap import disabled_by_env
from .context import StageContext, current_stage, current_weights
from .errors import ShimError
from .log import human_bytes, logger
from .support import (
    ACTIVATION,
    DOWNLOAD,
    ENDPOINT,
    HANDOFF,
    SHARDED_FORMAT,
    Plan,
    is_remote_uri,
    is_streaming_format,
    normalize_load_format,
    plan_for,
    split_anonymous,
)

STAGE_MODULE = "ray.llm._internal.batch.stages.vllm_engine_stage"
CLOUD_UTILS = "ray.llm._internal.common.utils.cloud_utils"
DOWNLOAD_UTILS = "ray.llm._internal.common.utils.download_utils"


@dataclasses.dataclass
class Applied:
    patch: str
    owner: Any
    attr: str
    original: Any
    replacement: Any

    @property
    def name(self) -> str:
        owner = getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None)
        if module and not isinstance(self.owner, ModuleType):
            owner = f"{module}.{owner}"
        return f"{owner}.{self.attr}"


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self.hooks_registered = False
        self.applied: list[Applied] = []
        self.appended: list[tuple[list, str]] = []  # in-place list edits (2.51)
        self.plan: Optional[Plan] = None
        self.announced = False


_state = _State()


# --------------------------------------------------------------------------- registry


def _wrap(patch: str, owner: Any, attr: str, wrapper: Callable) -> bool:
    """Wrap ``owner.attr`` once; the original is taken from ``__dict__`` for exact restore."""
    for a in _state.applied:
        if a.owner is owner and a.attr == attr and a.patch == patch:
            return False  # different patches on one name stack; restore unwinds them in order
    original = owner.__dict__[attr] if attr in vars(owner) else getattr(owner, attr)
    replacement = wrapt.FunctionWrapper(original, wrapper)
    setattr(owner, attr, replacement)
    _state.applied.append(Applied(patch, owner, attr, original, replacement))
    return True


def _restore_all() -> None:
    for a in reversed(_state.applied):
        current = vars(a.owner).get(a.attr)
        if current is a.replacement:
            setattr(a.owner, a.attr, a.original)
        else:
            logger.warning(
                "ray-runai-shim: %s was re-patched by someone else; leaving it, "
                "our wrapper is now inert",
                a.name,
            )
    _state.applied.clear()
    for lst, item in _state.appended:
        if item in lst:
            lst.remove(item)
    _state.appended.clear()


# --------------------------------------------------------------------------- plan


def _ray_plan() -> Optional[Plan]:
    if _state.plan is None:
        ray = sys.modules.get("ray")
        version = getattr(ray, "__version__", None)
        if version is None:
            return None
        _state.plan = plan_for(version)
    return _state.plan


def _announce(plan: Plan) -> None:
    """The one INFO line per job: what the shim does on this Ray, for Ray Data and Serve LLM."""
    if _state.announced:
        return
    _state.announced = True
    from . import __version__
    from .serve import serve_plan

    serve = serve_plan()
    patches = sorted(plan.patches | (serve.patches if serve else frozenset()))
    serve_why = f"; Serve LLM: {serve.why}" if serve is not None and serve.known else ""
    # Every Ray worker imports the shim; say it once per job (driver), quietly elsewhere.
    log = logger.debug if activation.in_ray_worker() else logger.info
    log(
        "ray-runai-shim %s: Ray %s: Ray Data: %s%s; %s",
        __version__,
        plan.ray_version,
        plan.why,
        serve_why,
        f"patching {', '.join(patches)}" if patches else "nothing to patch",
    )


def _wants(patch: str) -> bool:
    plan = _ray_plan()
    return plan is not None and patch in plan.patches


# --------------------------------------------------------------------------- Ray Data stage


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _bind(wrapped: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    key = getattr(wrapped, "__func__", wrapped)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(wrapped)
    bound = sig.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _udf_init(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Open the stage context for the duration of ``vLLMEngineStageUDF.__init__``."""
    ctx = None
    try:
        params = _bind(wrapped, args, kwargs)
        model = params.get("model")
        engine_kwargs = params.get("engine_kwargs") or {}
        load_format = normalize_load_format(engine_kwargs.get("load_format"))
        if is_streaming_format(load_format) and is_remote_uri(model):
            ctx = StageContext(model=model, load_format=load_format, engine_kwargs=dict(engine_kwargs))
    except Exception:
        logger.warning("ray-runai-shim: cannot read the stage's arguments; leaving Ray as is", exc_info=True)
    if ctx is None:
        return wrapped(*args, **kwargs)
    from .requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)  # ShimError: fail before any download
    token = current_stage.set(ctx)
    try:
        return wrapped(*args, **kwargs)
    finally:
        current_stage.reset(token)


def _torch_kernels_workaround() -> None:
    # Ray's download_model_files creates this before downloading; keep doing it.
    try:
        import torch

        os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
    except Exception:
        pass


def _download(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Replace the stage's full download by the non-weight fetch when streaming."""
    ctx = current_stage.get()
    if ctx is None or ctx.fell_back:
        return wrapped(*args, **kwargs)
    try:
        params = _bind(wrapped, args, kwargs)
        mode = getattr(params.get("download_model"), "name", None)
        ours = (
            params.get("model_id") == ctx.model
            and params.get("mirror_config") is None
            and mode == "MODEL_AND_TOKENIZER"
        )
    except Exception:
        logger.warning("ray-runai-shim: unexpected download call; using Ray's", exc_info=True)
        ours = False
    if not ours:
        return wrapped(*args, **kwargs)
    local_dir = narrowed_fetch(ctx)
    return wrapped(*args, **kwargs) if local_dir is None else local_dir


def narrowed_fetch(ctx: StageContext) -> Optional[str]:
    """Fetch the non-weight files for *ctx*; None (and ``ctx.fell_back``) on an unexpected
    failure, so the caller runs Ray's own download. ShimError propagates."""
    from .fetch import fetch_nonweights

    try:
        _torch_kernels_workaround()
        result = fetch_nonweights(ctx.model, ctx.load_format, ctx.engine_kwargs)
    except ShimError:
        raise
    except Exception:
        logger.warning(
            "ray-runai-shim: narrowed download of %s failed unexpectedly; falling back to "
            "Ray's full download (please report this)",
            ctx.model,
            exc_info=True,
        )
        ctx.fell_back = True
        return None
    ctx.local_dir = result.local_dir
    ctx.stats = {
        "fetched_files": result.fetched_files,
        "fetched_bytes": result.fetched_bytes,
        "nonweight_files": len(result.listing.nonweights),
        "weight_files": len(result.listing.weights),
        "weight_bytes": result.listing.weight_bytes,
        "reused": result.reused,
        "seconds": result.seconds,
    }
    return result.local_dir


def streamer_uri(uri: str) -> tuple[str, dict[str, str]]:
    """Ray's ``s3://anonymous@bucket/...`` means unsigned access; the streamer spells it
    ``s3://bucket/...`` plus ``RUNAI_STREAMER_S3_UNSIGNED=1``."""
    plain, anonymous = split_anonymous(uri)
    return plain, ({"RUNAI_STREAMER_S3_UNSIGNED": "1"} if anonymous else {})


HANDOFF_ENV = "RAY_RUNAI_SHIM_HANDOFF"  # auto | model_weights | config


def vllm_takes_model_weights() -> bool:
    """vLLM >= 0.14 has ``EngineArgs.model_weights``; older ones only read it off ModelConfig.

    ``RAY_RUNAI_SHIM_HANDOFF=config`` forces the older route (for vLLM builds whose
    field exists but misbehaves); ``=model_weights`` forces the field.
    """
    forced = os.environ.get(HANDOFF_ENV, "auto").strip().lower()
    if forced in ("model_weights", "config"):
        return forced == "model_weights"
    from vllm.engine import arg_utils

    return any(f.name == "model_weights" for f in dataclasses.fields(arg_utils.EngineArgs))


def _inject_weights(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM < 0.14: set ``model_config.model_weights`` on every config the args build.

    Ray builds the config twice from one args object (once itself, once inside
    ``from_engine_args``), so setting it once after the first call is not enough.
    """
    config = wrapped(*args, **kwargs)
    pending = current_weights.get()
    if pending is not None and getattr(instance, "model", None) == pending[0]:
        try:
            object.__setattr__(config.model_config, "model_weights", pending[1])
        except Exception:
            logger.warning("ray-runai-shim: could not set model_weights on vLLM's config", exc_info=True)
    return config


def _handoff_kwargs(
    ctx: StageContext, kwargs: dict, local_dir: Optional[str] = None
) -> tuple[dict, Optional[tuple[str, str]], str]:
    local_dir = local_dir or kwargs.get("model_source")
    weights_uri, env = streamer_uri(ctx.model)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    new = dict(kwargs)
    new.setdefault("served_model_name", ctx.model)
    inject = None
    if ctx.load_format == "tensorizer":
        extra = dict(new.get("model_loader_extra_config") or {})
        extra.setdefault("tensorizer_uri", f"{weights_uri.rstrip('/')}/model.tensors")
        new["model_loader_extra_config"] = extra
        how = f"tensorizer_uri={extra['tensorizer_uri']}"
    elif vllm_takes_model_weights():
        new.setdefault("model_weights", weights_uri)
        how = "model_weights"
    else:
        from vllm.engine import arg_utils

        _wrap(HANDOFF, arg_utils.EngineArgs, "create_engine_config", _inject_weights)
        inject = (local_dir, weights_uri)
        how = "model_config.model_weights"
    return new, inject, how


def _engine_init(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Hand vLLM the local non-weight dir as ``model`` and the URI for the weights."""
    ctx = current_stage.get()
    local_dir = kwargs.get("model_source")
    if (
        ctx is None
        or ctx.fell_back
        or not isinstance(local_dir, str)
        or is_remote_uri(local_dir)
        or not os.path.isdir(local_dir)
    ):
        return wrapped(*args, **kwargs)
    try:
        new_kwargs, inject, how = _handoff_kwargs(ctx, kwargs)
    except Exception:
        logger.warning("ray-runai-shim: handoff failed; vLLM gets Ray's arguments", exc_info=True)
        return wrapped(*args, **kwargs)
    _log_stage(ctx, local_dir, how)
    token = current_weights.set(inject) if inject else None
    try:
        return wrapped(*args, **new_kwargs)
    finally:
        if token is not None:
            current_weights.reset(token)


def _log_stage(ctx: StageContext, local_dir: str, how: str) -> None:
    s = ctx.stats
    if s:
        fetched = (
            f"reused {s['nonweight_files']} non-weight files"
            if s["reused"]
            else f"fetched {s['fetched_files']} non-weight files ({human_bytes(s['fetched_bytes'])})"
        )
        logger.info(
            "ray-runai-shim: %s in %.2f s to %s; skipped %d weight files (%s); "
            "vLLM streams weights from %s with load_format=%s (%s)",
            fetched,
            s["seconds"],
            local_dir,
            s["weight_files"],
            human_bytes(s["weight_bytes"]),
            ctx.model,
            ctx.load_format,
            how,
        )
    else:
        logger.info(
            "ray-runai-shim: vLLM reads config/tokenizer from %s and streams weights from %s "
            "with load_format=%s (%s)",
            local_dir,
            ctx.model,
            ctx.load_format,
            how,
        )


# --------------------------------------------------------------------------- hooks


def _on_ray(ray: ModuleType) -> None:
    plan = _ray_plan()
    if plan is None:
        return
    _announce(plan)
    if ACTIVATION not in plan.patches:
        return
    worker_mod = sys.modules.get("ray._private.worker")
    for owner in (worker_mod, ray):
        if owner is not None and hasattr(owner, "init"):
            _wrap(ACTIVATION, owner, "init", _ray_init)
    try:
        if ray.is_initialized() and not activation.in_ray_worker():
            logger.warning(
                "ray-runai-shim: Ray was initialized before ray_runai_shim was imported, so "
                "Ray Data actors will not load the shim. Import ray_runai_shim before "
                "ray.init(), or pass ray.init(runtime_env=ray_runai_shim.runtime_env())."
            )
    except Exception:
        pass


def _ray_init(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        kwargs = activation.prepare_init_kwargs(args, kwargs)
    except Exception:
        logger.warning("ray-runai-shim: could not extend the job's runtime_env", exc_info=True)
    return wrapped(*args, **kwargs)


def _on_cloud_utils(mod: ModuleType) -> None:
    if not _wants(ENDPOINT):
        return
    from .endpoint import get_fs_and_path_wrapper

    cfs = getattr(mod, "CloudFileSystem", None)
    if cfs is not None and "get_fs_and_path" in vars(cfs):
        _wrap(ENDPOINT, cfs, "get_fs_and_path", get_fs_and_path_wrapper)


def _on_download_utils(mod: ModuleType) -> None:
    formats = getattr(mod, "STREAMING_LOAD_FORMATS", None)
    if _wants(SHARDED_FORMAT) and isinstance(formats, list) and "runai_streamer_sharded" not in formats:
        formats.append("runai_streamer_sharded")  # in place: every alias sees it
        _state.appended.append((formats, "runai_streamer_sharded"))


def _on_stage(mod: ModuleType) -> None:
    plan = _ray_plan()
    if plan is None or not plan.patches & {DOWNLOAD, HANDOFF}:
        return
    udf = getattr(mod, "vLLMEngineStageUDF", None)
    wrapper_cls = getattr(mod, "vLLMEngineWrapper", None)
    if udf is None or wrapper_cls is None:
        logger.warning("ray-runai-shim: Ray %s's vLLM stage has an unexpected shape; not patching", plan.ray_version)
        return
    if "STREAMING_LOAD_FORMATS" in vars(mod):  # this stage already hands vLLM the URI (2.51+)
        return
    _wrap(HANDOFF, udf, "__init__", _udf_init)
    _wrap(HANDOFF, wrapper_cls, "__init__", _engine_init)
    # Only a streaming stage's full (MODEL_AND_TOKENIZER) download is replaced: on 2.45-2.49
    # that is every streaming format; 2.50 narrows runai_streamer/tensorizer itself
    # (EXCLUDE_SAFETENSORS) but still copies a runai_streamer_sharded checkpoint whole.
    if DOWNLOAD in plan.patches and callable(getattr(mod, "download_model_files", None)):
        _wrap(DOWNLOAD, mod, "download_model_files", _download)


def _serve_hooks() -> tuple[tuple[str, Callable[[ModuleType], None]], ...]:
    from .serve import HOOKS as serve_hooks  # imports this module's names above

    return serve_hooks


HOOKS: tuple[tuple[str, Callable[[ModuleType], None]], ...] = (
    ("ray", _on_ray),
    (CLOUD_UTILS, _on_cloud_utils),
    (DOWNLOAD_UTILS, _on_download_utils),
    (STAGE_MODULE, _on_stage),
    *_serve_hooks(),
)


def _guarded(fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def hook(module: ModuleType) -> None:
        with _state.lock:
            if not _state.installed:
                return
            try:
                fn(module)
            except Exception:  # an exception here would break `import ray`
                logger.warning("ray-runai-shim: patching %s failed; Ray is left unpatched there",
                               module.__name__, exc_info=True)

    return hook


# --------------------------------------------------------------------------- public


def install() -> bool:
    """Register the hooks (idempotent). False when disabled by the environment."""
    with _state.lock:
        if disabled_by_env():
            return False
        if _state.installed:
            return True
        _state.installed = True
        if not _state.hooks_registered:
            _state.hooks_registered = True
            for name, fn in HOOKS:
                # Fires now if the module is already imported, else right after it is.
                wrapt.register_post_import_hook(_guarded(fn), name)
        else:
            for name, fn in HOOKS:
                if name in sys.modules:
                    _guarded(fn)(sys.modules[name])
        return True


def uninstall() -> None:
    """Restore every patched name exactly; hooks stay registered but inert."""
    with _state.lock:
        _restore_all()
        _state.installed = False


def status() -> dict[str, Any]:
    """What the shim did in *this* process (run it inside a Ray task to see a worker's)."""
    from . import __version__
    from .serve import serve_plan

    with _state.lock:
        plan = _ray_plan()
        serve = serve_plan()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "installed": _state.installed,
            "disabled_by_env": disabled_by_env(),
            "ray_version": plan.ray_version if plan else None,
            "plan": sorted(plan.patches) if plan else [],
            "why": plan.why if plan else "Ray is not imported in this process yet",
            "patched": sorted({a.name for a in _state.applied}),
            "patches_applied": sorted({a.patch for a in _state.applied}),
            "serve_plan": sorted(serve.patches) if serve else [],
            "serve_why": serve.why if serve else None,
        }
