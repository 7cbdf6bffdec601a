"""vLLM's engine config: read the weights once per node (the relay), within one memory budget.

Wrapped where every front-end meets vLLM, in the process that builds the engine (Ray Data's
stage actor, a Serve replica, a plain driver): ``EngineArgs.create_engine_config``. After
vLLM built its config, the weights URI it will stream (``model_config.model_weights``, or
``model`` itself) is swapped for a node-local copy when two or more readers on this node
will load it -- the tensor-parallel / pipeline-parallel ranks of this engine times the
engines of the model per node (``RAY_RUNAI_SHIM_NODE_ENGINES``; for Ray Data's stage the shim
derives it from the actor pool's size and the cluster's nodes) -- so each rank and engine streams
local memory with the same ``runai_streamer`` format. One reader alone keeps streaming from
the store. The hold on the copy ends when this process's engine is ready (vLLM's
``AsyncLLM`` / ``LLMEngine`` constructors return only after every rank loaded), and the last
reader on the node frees it (:mod:`..snapshot.relay`).

Where the user has not bounded the streamer's host memory (``RUNAI_STREAMER_MEMORY_LIMIT`` or
``model_loader_extra_config["memory_limit"]``), the readers on the node share one budget taken
from the node's and the container's free memory (:mod:`..snapshot.memory`): N readers at the
streamer's default 40 GB each can no longer push the node into OOM. Readers of the relay's copy
get a smaller buffer still (local memory needs no deep read-ahead; it loads faster). The limit
travels in the engine's load config too, so ranks of vLLM's Ray executor get it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import ShimError
from ..failopen import NotApplicable, fail_open
from ..log import human_bytes, logger
from ..snapshot import headers, memory
from ..snapshot import relay as node_relay
from ..snapshot.handoff import UNSIGNED
from ..tables import settings
from ..tables.support import is_remote_uri, join_anonymous, normalize_load_format

MEMORY_LIMIT = settings.STREAMER_MEMORY_LIMIT
#: The streamer's per-request timeout (default 1000 ms). Measured through a link that stalls (bench
#: notes, docs/node-relay.md): a stall over ~5 s made the default re-request ranges (+27 % bytes from
#: the store, still finishing); 30 s re-requested nothing. Set only where the user has not.
REQUEST_TIMEOUT = settings.STREAMER_REQUEST_TIMEOUT
REQUEST_TIMEOUT_MS = "30000"
RELAYED_FORMATS = ("runai_streamer",)

_lock = threading.Lock()
_held: list[node_relay.Relay] = []
#: What the relay decided for each engine this process built (``status()["relay"]``).
decisions: list[str] = []


def _decided(text: str) -> None:
    with _lock:
        decisions.append(text)
        del decisions[:-8]


def readers_on_node(engine_args: Any) -> int:
    """The ranks of this engine (TP x PP; all on this node unless Ray places them) times the
    engines of this model per node: ``RAY_RUNAI_SHIM_NODE_ENGINES`` (set by the user, or by the
    shim on Ray Data's stage), else a Serve replica's deployment size spread over the nodes."""
    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(engine_args, "pipeline_parallel_size", 1) or 1)
    engines = settings.count(settings.NODE_ENGINES, 0, low=1)
    if not engines:
        replicas = serve_replicas()
        engines = engines_per_node(replicas) if replicas else 1
    return tp * pp * engines


def serve_replicas() -> Optional[int]:
    """In a Serve replica: its deployment's replica count -- ``num_replicas``, or with autoscaling
    the replicas that start together (``initial_replicas``, else ``min_replicas``). Read from
    the replica context every Ray release sets before the replica builds its engine."""
    context = sys.modules.get("ray.serve.context")  # never import Serve where it is not running
    get = getattr(context, "_get_internal_replica_context", None)
    replica = get() if get is not None else None
    config = getattr(replica, "_deployment_config", None)
    if config is None:
        return None
    count = getattr(config, "num_replicas", None)
    autoscaling = getattr(config, "autoscaling_config", None)
    if autoscaling is not None:
        count = getattr(autoscaling, "initial_replicas", None) or getattr(autoscaling, "min_replicas", None)
    return count if isinstance(count, int) and count > 0 else None


def _engines(map_batches_kwargs: dict) -> int:
    """Ray Data's engine count for the stage: the actor pool's size (or ``concurrency``)."""
    compute = map_batches_kwargs.get("compute")
    size = getattr(compute, "max_size", None) or getattr(compute, "min_size", None)
    if size is None:
        size = map_batches_kwargs.get("concurrency")
    if isinstance(size, (tuple, list)):
        size = max(int(v) for v in size if v is not None)
    return int(size) if isinstance(size, int) and size > 0 else 1


def engines_per_node(engines: int) -> int:
    """*engines* spread over the cluster's alive nodes (at least two share a node when there
    are more engines than nodes)."""
    try:
        import ray

        nodes = sum(1 for n in ray.nodes() if n.get("Alive")) if ray.is_initialized() else 1
    except Exception:
        nodes = 1
    return -(-engines // max(1, nodes))


@fail_open("counting the stage's engines per node for the node relay",
           fallback="the relay counts only the ranks of each engine (set RAY_RUNAI_SHIM_NODE_ENGINES)")
def stage_init(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Ray Data's ``vLLMEngineStage`` (driver side): tell its actors how many engines of the
    model share a node, through the stage's runtime_env (set-if-absent; the user's value wins)."""
    ctor = kwargs.get("fn_constructor_kwargs") or {}
    batches = kwargs.get("map_batches_kwargs")
    engine_kwargs = ctor.get("engine_kwargs") or {}
    if (args or not isinstance(batches, dict)
            or normalize_load_format(engine_kwargs.get("load_format")) not in RELAYED_FORMATS
            or not is_remote_uri(ctor.get("model"))):
        raise NotApplicable("not a streamed object-store model built by keyword")
    engines = _engines(batches)
    if engines < 2 or os.environ.get(settings.NODE_ENGINES):
        raise NotApplicable("one engine, or the user said how many share a node")
    runtime_env = dict(batches.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.setdefault(settings.NODE_ENGINES, str(engines_per_node(engines)))
    runtime_env["env_vars"] = env_vars
    return original(*args, **{**kwargs, "map_batches_kwargs": {**batches, "runtime_env": runtime_env}})


def ranks_all_here(engine_args: Any) -> bool:
    """Will every rank of this engine run on this node? vLLM's mp / uni executors keep them
    here; its Ray executor places them by the placement group this process runs in (Serve LLM
    always uses it): all its bundles on this node, or no relay -- a copy in this node's memory
    means nothing to a rank on another node (vllm#50616's shape)."""
    backend = getattr(engine_args, "distributed_executor_backend", None)
    world = int(getattr(engine_args, "tensor_parallel_size", 1) or 1) * int(
        getattr(engine_args, "pipeline_parallel_size", 1) or 1)
    if backend in (None, "mp", "uni"):
        return True
    if backend != "ray":
        return world == 1 and backend != "external_launcher"
    try:
        import ray

        pg = ray.util.get_current_placement_group()
        if pg is None:
            return False
        nodes = set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values())
        return nodes == {ray.get_runtime_context().get_node_id()}
    except Exception:
        return False


def relay_wanted(readers: int) -> bool:
    mode = node_relay.mode()
    return mode == "on" or (mode == "auto" and readers >= 2)


def _extra(engine_args: Any) -> dict:
    extra = getattr(engine_args, "model_loader_extra_config", None) or {}
    return extra if isinstance(extra, dict) else {}


def user_memory_limit(engine_args: Any) -> bool:
    return bool(os.environ.get(MEMORY_LIMIT)) or _extra(engine_args).get("memory_limit") is not None


FsAndPath = Optional[Callable[[str], tuple[Any, str]]]


def _checkpoint(weights: str, fs_and_path: FsAndPath) -> tuple[int, Callable[[], int]]:
    """(weight bytes, a call giving the largest tensor) of the checkpoint at *weights*: the
    relay's local copy, or the store (one listing; the headers only when asked)."""
    if not is_remote_uri(weights):
        files = sorted(Path(weights).rglob("*.safetensors"))
        return sum(f.stat().st_size for f in files), lambda: headers.largest_local(files)
    from ..snapshot.fetch import default_fs_and_path, list_model, open_store

    fs_and_path = fs_and_path or default_fs_and_path
    fs, prefix, _ = opened = open_store(weights, fs_and_path)
    listing = list_model(weights, fs_and_path, opened)
    keys = [f"{prefix}/{f.key}" for f in listing.weights if f.key.endswith(".safetensors")]
    return listing.weight_bytes, lambda: headers.largest_remote(fs, keys)


def set_budget(readers: int, weights: str, fs_and_path: FsAndPath = None) -> Optional[int]:
    """Give this process's streamer (and the ranks it starts, which inherit the environment)
    its share of the node's memory for *readers* readers of *weights*; measured after the
    relay's copy is in place, so the copy and the buffers fit together. Readers of the relay's
    local copy (*weights* a local path) also get a smaller buffer: local memory needs no deep
    read-ahead (:data:`..snapshot.memory.LOCAL_READ_BYTES`). One reader alone keeps the
    streamer's default (as without the shim: no request, no setting). Returns the limit set."""
    if readers < 2:
        return None
    local = not is_remote_uri(weights)
    room = memory.room(Path("/dev/shm"))
    usable = room.usable()
    budget = memory.reader_budget(readers, usable)
    if budget is None and not local:
        return None  # 40 GB each fits: nothing to read
    total, largest_of = _checkpoint(weights, fs_and_path)
    budget = memory.reader_budget(readers, usable, total=total)
    largest = largest_of() if budget is not None or local else 0
    if budget is not None:
        budget = memory.reader_budget(readers, usable, largest=largest, total=total)
    if local:
        budget = memory.local_read_limit(budget, largest, total)
    if budget is None:
        return None  # the default buffers the whole checkpoint, and that fits
    os.environ[MEMORY_LIMIT] = str(budget)
    if budget == memory.MINIMAL:
        logger.warning(
            "ray-runai-shim: %s of memory to spare for %d weight reader(s) on this node is less than the largest "
            "tensor (%s) each: the streamer reads one tensor at a time (%s=0); free memory or set %s (%s)",
            human_bytes(usable), readers, human_bytes(largest), MEMORY_LIMIT, MEMORY_LIMIT, room.describe())
    else:
        logger.info("ray-runai-shim: streamer memory budget %s per reader (%d readers on this node; %s)",
                    human_bytes(budget), readers, room.describe())
    return budget


def _budget_to_ranks(config: Any, budget: int) -> None:
    """Carry *budget* in the engine's load config (``model_loader_extra_config["memory_limit"]``,
    which vLLM's runai loader turns into ``RUNAI_STREAMER_MEMORY_LIMIT`` in the process that
    loads): ranks of vLLM's Ray executor are Ray workers that never see this process's
    environment, and the config reaches every rank whatever the executor."""
    load_config = getattr(config, "load_config", None)
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    if load_config is not None and isinstance(extra, dict):
        object.__setattr__(load_config, "model_loader_extra_config", {**extra, "memory_limit": budget})


def _weights_of(model_config: Any) -> Optional[str]:
    weights = getattr(model_config, "model_weights", None) or getattr(model_config, "model", None)
    return weights if isinstance(weights, str) and is_remote_uri(weights) else None


STREAMER_FORMATS = ("runai_streamer", "runai_streamer_sharded")


def _readable_limit(raw: Any) -> bool:
    try:
        return not isinstance(raw, bool) and int(str(raw)) >= -1
    except ValueError:
        return False


def check_memory_limit(engine_args: Any) -> None:
    """Name a streamer memory limit the streamer cannot read, before the engine starts: it
    reads ``RUNAI_STREAMER_MEMORY_LIMIT`` with ``int()`` only when a rank loads, deep in the
    engine's start, and fails there with ``invalid literal for int()``."""
    for where, raw in ((MEMORY_LIMIT, os.environ.get(MEMORY_LIMIT)),
                       ('model_loader_extra_config["memory_limit"]', _extra(engine_args).get("memory_limit"))):
        if raw is None or _readable_limit(raw):
            continue
        raise ShimError(
            f"ray-runai-shim: {where}={raw!r} is not a limit the Run:ai streamer can read: it takes a whole number "
            "of bytes (e.g. 4000000000 for 4 GB; 0: one tensor at a time; -1: no limit), no units, and would fail "
            f"on {raw!r} only once the engine loads its weights. Fix: set it to a number of bytes, or unset it "
            "and the shim shares the node's memory among its readers.")


@fail_open("the node relay", fallback="this engine streams its weights from the store itself")
def create_engine_config(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    if normalize_load_format(getattr(instance, "load_format", None)) in STREAMER_FORMATS:
        check_memory_limit(instance)
    if normalize_load_format(getattr(instance, "load_format", None)) not in RELAYED_FORMATS:
        raise NotApplicable("not the runai_streamer load format")
    if _extra(instance).get("distributed"):
        _decided("distributed streaming asked for: left to vLLM, which splits the reads among the ranks")
        raise NotApplicable("distributed streaming asked for: vLLM splits the reads among the ranks")
    config = original(*args, **kwargs)
    model_config = getattr(config, "model_config", None)
    uri = _weights_of(model_config)
    if uri is None:
        return config  # local weights or a hub id: nothing to relay
    readers = readers_on_node(instance)
    os.environ.setdefault(REQUEST_TIMEOUT, REQUEST_TIMEOUT_MS)  # inherited by the engine core and its ranks
    got = None
    if not relay_wanted(readers):
        _decided(f"{readers} reader(s) on this node: stream {uri} from the store (relay {node_relay.mode()})")
    elif not ranks_all_here(instance):
        _decided(f"the ranks of this engine may run on other nodes: each streams {uri} from the store")
        logger.info("ray-runai-shim: not relaying %s: this engine's ranks are not all on this node", uri)
    else:
        unsigned = os.environ.get(UNSIGNED) == "1"  # the streamer's spelling of Ray's s3://anonymous@
        got = node_relay.acquire(join_anonymous(uri) if unsigned else uri)
        if got is None:  # no copy (does not fit, unsafe directory, failed or stalled): acquire said why
            _decided(f"{readers} reader(s): no relay copy on this node (see its WARNING); stream {uri} from the store")
        else:
            _decided(f"{readers} reader(s) on this node: {uri} relayed through {got.path}")
            object.__setattr__(model_config, "model_weights", got.uri)
            with _lock:
                _held.append(got)
            logger.info("ray-runai-shim: %d reader(s) on this node stream %s from the node relay %s",
                        readers, uri, got.path)
    if not user_memory_limit(instance):
        _budget_quietly(config, readers, str(got.path) if got is not None else uri)
    return config


def _budget_quietly(config: Any, readers: int, weights: str) -> None:
    try:
        budget = set_budget(readers, weights)
        if budget is not None:
            _budget_to_ranks(config, budget)
    except Exception:  # a budget not set must not stop the engine: the streamer's default stays
        logger.warning("ray-runai-shim: could not work out the streamer memory budget for %s; the streamer "
                       "keeps its default limit", weights, exc_info=True)


def release_all() -> None:
    """This process's engine has loaded (or given up): drop its holds on relay copies."""
    with _lock:
        held = list(_held)
        _held.clear()
    for got in held:
        try:
            node_relay.release(got)
        except Exception:
            logger.warning("ray-runai-shim: could not release the node relay copy %s", got.path, exc_info=True)


atexit.register(release_all)


@fail_open("releasing the node relay copy", fallback="the copy is freed when this process exits")
def engine_ready(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    with _lock:
        if not _held:
            raise NotApplicable("no relay copy held in this process")
    try:
        return original(*args, **kwargs)
    finally:
        release_all()
