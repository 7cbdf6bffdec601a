"""Ray Serve LLM on Ray 2.45-2.51: the same narrowed download and handoff as the batch stage.

Serve's node initialisation (``_initialize_local_node``, inside the replica)
calls ``download_model_files(..., MODEL_AND_TOKENIZER)`` for a string URI and
for a ``CloudMirrorConfig`` source alike, sets ``hf_model_id`` to the local
copy, preloads the tokenizer from it, and hands that copy to vLLM -- whatever
``engine_kwargs["load_format"]`` says. The shim keeps Ray's flow and changes
two things:

1. **Download.** While ``_initialize_local_node`` runs for a streaming format
   and a remote source (:func:`local_node`), the node-init module's
   ``download_model_files`` fetches only the non-weight files and returns that
   directory (:func:`local_node_download`). Ray then sets ``hf_model_id`` to it,
   so the tokenizer preload and ``apply_checkpoint_info`` read real local
   files. Mirror ``extra_files`` are still fetched by Ray (``download_model=NONE``).
   ``_initialize_local_node`` runs its body in an executor thread, where a
   ContextVar set by the caller is not visible; a lock-guarded map keyed by
   (model id, mirror URI) carries the decision across, for exactly that call.
   Ray 2.51 downloads in ``initialize_remote_node`` tasks whose
   ``download_model_files`` call carries a ``callback`` holding the LLMConfig,
   so the decision is read from there (:func:`remote_node_download`).
2. **Handoff.** ``VLLMEngineConfig.get_initialization_kwargs`` -- where every
   2.45-2.51 release builds vLLM's arguments -- gives vLLM ``model=<that dir>``
   plus the weights URI (:func:`hand_off`, a step of :mod:`.serve_engine_kwargs`). It recognises the directory by
   the manifest the fetch wrote, so it also works where Ray builds the engine
   config in a separate ``ray.remote`` task (GPU deployments).

3. **Pipeline parallelism > 1 on 2.45-2.50.** Ray's ``initialize_worker_nodes``
   runs the full download in a ``ray.remote(download_model_files)`` task on every
   node of the placement group and ignores the paths, so vLLM (and, on 2.45-2.47,
   ``apply_checkpoint_info``) get the bare URI or model id and the deployment
   fails after every node copied the weights. :func:`worker_nodes` runs
   :func:`node_fetch` on each of those nodes instead (a plain module-level
   function: Ray pickles it by reference, so the node runs the shim's code) and
   sets ``hf_model_id`` to the directory, which is the same path on every node.

2.52+ download nothing for a streaming format; 2.52-2.58's bare-``model_id``
handoff is :mod:`.serve_mirror`'s.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Optional

from ..context import StageContext
from ..errors import ShimError
from ..failopen import NotApplicable, fail_open, step
from ..log import logger
from ..snapshot.cache import snapshot_source
from ..snapshot.nonweights import fetch_for
from ..stores.azure import warn_if_azure
from ..tables.support import is_streaming_format, normalize_load_format
from .decide import FULL, apply_handoff, bind, download_kind, mirror_uri, streaming_request

COPIES = "Ray's own download runs instead and copies the whole model, weights included"

_lock = threading.Lock()
#: (model id as Ray passes it, mirror bucket URI or None) -> the streaming decision.
_armed: dict[tuple[Optional[str], Optional[str]], StageContext] = {}
#: local dir -> the context that fetched it (for the one INFO line with sizes).
_fetched: dict[str, StageContext] = {}


def _engine_config_of(target: Any) -> Any:
    """2.45-2.48 pass the VLLMEngineConfig, 2.49-2.51 the LLMConfig."""
    get = getattr(target, "get_engine_config", None)
    return get() if callable(get) else target


def _mirror_of(engine_config: Any) -> Optional[str]:
    return mirror_uri(getattr(engine_config, "mirror_config", None))


def streaming_source(engine_config: Any) -> Optional[StageContext]:
    """A context when this engine streams from an object store (string URI or mirror)."""
    mirror = getattr(engine_config, "mirror_config", None)
    uri = mirror_uri(mirror) if mirror is not None else engine_config.actual_hf_model_id
    engine_kwargs = getattr(engine_config, "engine_kwargs", None)
    ctx = streaming_request(uri, engine_kwargs)
    if ctx is None:
        warn_if_azure(uri, engine_kwargs)
    return ctx


# --------------------------------------------------------------------------- download


@fail_open("reading Serve's node-init arguments", fallback=COPIES)
def local_node(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Arm the narrowed download for this ``_initialize_local_node`` call."""
    target = args[0] if args else kwargs.get("engine_config", kwargs.get("llm_config"))
    engine_config = _engine_config_of(target)
    ctx = streaming_source(engine_config)
    if ctx is None or getattr(kwargs.get("download_model"), "name", None) != "MODEL_AND_TOKENIZER":
        raise NotApplicable("not a streaming engine's full node-init download")
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)  # ShimError before any download
    key = (engine_config.actual_hf_model_id, _mirror_of(engine_config))
    with _lock:
        _armed[key] = ctx

    def disarm(*_: Any) -> None:
        with _lock:
            if _armed.get(key) is ctx:
                del _armed[key]

    try:
        result = original(*args, **kwargs)
    except BaseException:
        disarm()
        raise
    if hasattr(result, "add_done_callback"):
        result.add_done_callback(disarm)  # the executor thread has run the download by then
    else:
        disarm()
    return result


def _fetch_then_extras(original: Callable[..., Any], params: dict, ctx: StageContext) -> str:
    local_dir = fetch_for(ctx)
    mirror = params.get("mirror_config")
    extras = params.get("download_extra_files") and getattr(mirror, "extra_files", None)
    if extras or params.get("callback") is not None:
        # Ray's own extra-files download (and, on 2.51, the user's callback hooks), without the model.
        original(**{**params, "download_model": type(params["download_model"]).NONE})
    with _lock:
        _fetched[local_dir] = ctx
    return local_dir


@fail_open("the narrowed node-init download", fallback=COPIES)
def local_node_download(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """In the armed call only: the non-weight fetch instead of Ray's full download."""
    with _lock:
        armed = bool(_armed)
    if not armed:
        raise NotApplicable("no streaming node init in progress")
    params = bind(original, args, kwargs)
    with _lock:
        ctx = _armed.get((params.get("model_id"), mirror_uri(params.get("mirror_config"))))
    if ctx is None or ctx.fell_back or download_kind(params) != FULL:
        raise NotApplicable("not the armed engine's full download")
    return _fetch_then_extras(original, params, ctx)


@fail_open("the narrowed node-init download", fallback=COPIES)
def remote_node_download(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Ray 2.51: ``initialize_remote_node`` downloads with a ``callback`` whose
    ``llm_config`` says what the engine will load."""
    params = bind(original, args, kwargs)
    llm_config = getattr(params.get("callback"), "llm_config", None)
    if llm_config is None:
        raise NotApplicable("no LLMConfig on the download callback")
    engine_config = llm_config.get_engine_config()
    ctx = streaming_source(engine_config)
    if ctx is None or download_kind(params, engine_config.actual_hf_model_id, _mirror_of(engine_config)) != FULL:
        raise NotApplicable("not a streaming engine's full download")
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)
    return _fetch_then_extras(original, params, ctx)


# --------------------------------------------------------------------------- PP > 1 (2.45-2.50)


def node_fetch(ctx: StageContext, model_id: str, mirror_config: Any, extra_files: bool) -> tuple[str, str, dict]:
    """On one node of the placement group: the non-weight snapshot, plus a mirror's extra
    files (Ray's own download of them, without the model). Returns (node id, dir, stats)."""
    import ray

    local_dir = fetch_for(ctx)
    if extra_files and getattr(mirror_config, "extra_files", None):
        from ray.llm._internal.common.utils.download_utils import NodeModelDownloadable, download_model_files

        download_model_files(model_id=model_id, mirror_config=mirror_config,
                             download_model=NodeModelDownloadable.NONE, download_extra_files=True)
    return ray.get_runtime_context().get_node_id(), local_dir, ctx.stats


async def _fetch_on_nodes(original: Callable[..., Any], args: tuple, kwargs: dict, params: dict,
                          engine_config: Any, ctx: StageContext) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        nodes = sorted(set(ray.util.placement_group_table(params["placement_group"])["bundles_to_node_id"].values()))
        task = ray.remote(node_fetch)
        results = await asyncio.gather(*[
            task.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                         runtime_env=params.get("runtime_env")).remote(
                ctx, engine_config.actual_hf_model_id, engine_config.mirror_config, params.get("download_extra_files"))
            for node in nodes
        ])
    except ShimError:
        raise
    except Exception:
        logger.warning("ray-runai-shim: the per-node non-weight fetch failed (a shim bug; please report it): %s",
                       COPIES, exc_info=True)
        return await original(*args, **kwargs)
    dirs = sorted({d for _node, d, _stats in results})
    if len(dirs) != 1:
        raise ShimError(
            f"ray-runai-shim: the nodes of this deployment's placement group put the non-weight files of "
            f"{ctx.model} at different paths ({', '.join(dirs)}), but vLLM is handed one path for all of them. "
            "Fix: give every node the same HF_HOME (or RAY_RUNAI_SHIM_CACHE_DIR), writable by the Ray workers."
        )
    ctx.local_dir, ctx.stats = dirs[0], results[0][2]
    engine_config.hf_model_id = ctx.local_dir  # the cached config Ray reads from here on
    with _lock:
        _fetched[ctx.local_dir] = ctx
    logger.info("ray-runai-shim: the non-weight files of %s are at %s on all %d node(s) of the placement group "
                "(pipeline parallel); no weight file was copied", ctx.model, ctx.local_dir, len(results))


@fail_open("reading Serve's per-node download", fallback=COPIES)
def worker_nodes(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``initialize_worker_nodes`` (PP > 1): the non-weight fetch on every node, and the path kept."""
    params = bind(original, args, kwargs)
    engine_config = params["llm_config"].get_engine_config()
    ctx = streaming_source(engine_config)
    if ctx is None or getattr(params.get("download_model"), "name", None) != "MODEL_AND_TOKENIZER":
        raise NotApplicable("not a streaming engine's full per-node download")
    from ..snapshot.requirements import check_loader_importable

    check_loader_importable(ctx.model, ctx.load_format)
    return _fetch_on_nodes(original, args, kwargs, params, engine_config, ctx)


# --------------------------------------------------------------------------- handoff


@step("the Serve weights handoff", fallback="vLLM gets Ray's arguments")
def hand_off(instance: Any, result: dict) -> Optional[dict]:
    """A step of :mod:`.serve_engine_kwargs`: vLLM gets the local non-weight dir as ``model``
    and the weights URI, where Ray's kwargs (*result*) point at a dir the shim fetched."""
    local_dir = instance.actual_hf_model_id
    uri = snapshot_source(local_dir)
    load_format = normalize_load_format((instance.engine_kwargs or {}).get("load_format"))
    if uri is None or not is_streaming_format(load_format) or not os.path.isdir(local_dir):
        raise NotApplicable("not a non-weight dir the shim fetched, for a streaming format")
    mirror = _mirror_of(instance)
    if mirror is not None and mirror.rstrip("/") != uri:
        raise NotApplicable("someone else's snapshot; never guess")
    with _lock:
        ctx = _fetched.get(local_dir)
    if ctx is None or ctx.model.rstrip("/") != uri:
        ctx = StageContext(model=uri, load_format=load_format, engine_kwargs=dict(instance.engine_kwargs))
    # 2.45-2.47 put ``model`` in front of these kwargs; a key here wins.
    return apply_handoff(ctx, {**result, "model": local_dir}, local_dir).kwargs
