"""vLLM's engine config: read the weights once per node (the relay), within one memory budget.

Run where every front-end meets vLLM, in the process that builds the engine (Ray Data's
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

What an engine meets, in order: :func:`stage_init` (Ray Data's driver: how many engines share
a node), the engine-config hook's steps :func:`checks` and :func:`relay_config` (count the
readers, :mod:`.reader_count`; relay or stream; the memory budget, :mod:`.relay_budget`;
:mod:`.engine_config` runs them), :func:`engine_ready` (release).
"""

from __future__ import annotations

import atexit
import importlib
import os
import site
import threading
import time
from typing import Any, Callable, Optional

from .. import registry
from ..failopen import NotApplicable, fail_open, step
from ..log import logger
from ..snapshot import relay as node_relay
from ..snapshot.handoff import UNSIGNED
from ..tables import settings
from ..tables.support import is_remote_uri, join_anonymous, normalize_load_format
from ..tables.targets import VLLM_RUNAI_LOADER
from .reader_count import (
    cluster_relays,
    engines_per_node,
    engines_to_wait_for,
    ranks_all_here,
    readers_on_node,
    relay_for_the_cluster,
    relay_wanted,
    stage_engines,
)
from .relay_budget import (
    REQUEST_TIMEOUT,
    REQUEST_TIMEOUT_MS,
    STREAMER_FORMATS,
    budget_quietly,
    check_memory_limit,
    loader_extra,
    user_memory_limit,
)

RELAYED_FORMATS = ("runai_streamer",)
READER_DOOR = "RunaiModelStreamerLoader._get_weights_iterator"
#: Tests turn this off: every reader waits for the whole copy (the control of the pipelined relay).
PIPELINE = True

_lock = threading.Lock()
_held: list[node_relay.Relay] = []
#: What the relay decided for each engine this process built (``status()["relay"]``).
decisions: list[str] = []


def _decided(text: str) -> None:
    with _lock:
        decisions.append(text)
        del decisions[:-8]


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
    engines = stage_engines(batches)
    if engines < 2 or os.environ.get(settings.NODE_ENGINES):
        raise NotApplicable("one engine, or the user said how many share a node")
    runtime_env = dict(batches.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.setdefault(settings.NODE_ENGINES, str(engines_per_node(engines)))
    runtime_env["env_vars"] = env_vars
    return original(*args, **{**kwargs, "map_batches_kwargs": {**batches, "runtime_env": runtime_env}})


def _weights_of(model_config: Any) -> Optional[str]:
    weights = getattr(model_config, "model_weights", None) or getattr(model_config, "model", None)
    return weights if isinstance(weights, str) and is_remote_uri(weights) else None


RELAY_FALLBACK = "this engine streams its weights from the store itself"


@step("the node relay's checks", fallback=RELAY_FALLBACK)
def checks(instance: Any) -> Optional[bool]:
    """Before vLLM builds the config: the streamer's memory limit (a ShimError for a wrong one)
    and whether this engine's format and loader leave anything to relay (True)."""
    load_format = normalize_load_format(getattr(instance, "load_format", None))
    if load_format in STREAMER_FORMATS:
        check_memory_limit(instance)
    if load_format not in RELAYED_FORMATS:
        raise NotApplicable("not the runai_streamer load format")
    if loader_extra(instance).get("distributed"):
        _decided("distributed streaming asked for: left to vLLM, which splits the reads among the ranks")
        raise NotApplicable("distributed streaming asked for: vLLM splits the reads among the ranks")
    return True


@step("the node relay", fallback=RELAY_FALLBACK)
def relay_config(config: Any, instance: Any) -> None:
    """After vLLM built *config*: count the readers on this node, relay or stream, budget."""
    model_config = getattr(config, "model_config", None)
    uri = _weights_of(model_config)
    if uri is None:
        raise NotApplicable("local weights or a hub id: nothing to relay")
    readers = readers_on_node(instance)
    os.environ.setdefault(REQUEST_TIMEOUT, REQUEST_TIMEOUT_MS)  # inherited by the engine core and its ranks
    got = None
    cluster = relay_for_the_cluster(readers, ranks_read_as_it_lands(arm=False))
    if not (relay_wanted(readers) or cluster):
        _decided(f"{readers} reader(s) on this node: stream {uri} from the store (relay {node_relay.mode()})")
    elif not ranks_all_here(instance):
        if cluster_relays():
            _decided(f"the ranks of this engine may run on other nodes: each takes {uri} through its node's relay")
        else:
            _decided(f"the ranks of this engine may run on other nodes: each streams {uri} from the store")
        logger.info("ray-runai-shim: not relaying %s here: this engine's ranks are not all on this node", uri)
    else:
        unsigned = os.environ.get(UNSIGNED) == "1"  # the streamer's spelling of Ray's s3://anonymous@
        pipelined = ranks_read_as_it_lands()
        got = node_relay.acquire(join_anonymous(uri) if unsigned else uri, pipelined=pipelined,
                                 readers=engines_to_wait_for())
        if got is None:  # no copy (does not fit, unsafe directory, failed or stalled): acquire said why
            _decided(f"{readers} reader(s): no relay copy on this node (see its WARNING); stream {uri} from the store")
        else:
            how = ("its ranks read each range as it lands" if got.live else
                   "the copy is whole" if pipelined else "its ranks wait for the whole copy")
            why = "shared with the cluster's other nodes" if cluster else f"{readers} reader(s) on this node"
            _decided(f"{why}: {uri} relayed through {got.path} ({how})")
            object.__setattr__(model_config, "model_weights", got.uri)
            with _lock:
                _held.append(got)
            logger.info("ray-runai-shim: %d reader(s) on this node stream %s from the node relay %s (%s; pid %d)",
                        readers, uri, got.path, how, os.getpid())
    if not user_memory_limit(instance):
        if got is not None and got.live:  # the ranks read node memory: the local rule, figures from the store
            budget_quietly(config, readers, uri, local=True)
        else:
            budget_quietly(config, readers, str(got.path) if got is not None else uri)


def _autoload_installed() -> bool:
    """The wheel's autoload ``.pth`` is in this interpreter's site-packages (an interpreter
    started with ``RAY_RUNAI_SHIM_AUTOLOAD=1`` loads the shim)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(os.path.isfile(os.path.join(d, settings.AUTOLOAD_PTH)) for d in dirs)


def ranks_read_as_it_lands(arm: bool = True) -> bool:
    """The ranks will read a copy in progress as it lands: this vLLM's runai loader has the
    door the shim wraps (:mod:`.runai_loader`) and vLLM's engine core and workers, started from
    this process, load the shim at interpreter start: the wheel's autoload ``.pth`` is
    installed and ``RAY_RUNAI_SHIM_AUTOLOAD=1`` is set here for them (unless the user set it
    to something else). Otherwise the relay hands over only a whole copy: a rank without the
    shim finds no files, never a half copy. *arm* False: only say whether they would."""
    if not PIPELINE or os.environ.get(settings.AUTOLOAD, "1") != "1" or not _autoload_installed():
        return False
    try:
        importlib.import_module(VLLM_RUNAI_LOADER)  # its post-import hook wraps the loader here too
    except Exception:
        return False
    if f"{VLLM_RUNAI_LOADER}.{READER_DOOR}" not in {name for _patch, name in registry.applied()}:
        return False
    if not arm:
        return True
    os.environ[settings.AUTOLOAD] = "1"  # inherited by vLLM's engine core and its workers, which
    os.environ[settings.RELAY_READERS] = "1"  # then install the shim's Ray-free patches at start
    return True


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
        else:
            with _lock:
                _copying.append(got)


def _at_exit() -> None:
    """At exit, a copy this process still makes is finished (bounded), so that it frees what it
    leaves: an interpreter's exit stops its threads mid-copy, which the next use would sweep."""
    release_all()
    with _lock:
        copying, _copying[:] = list(_copying), []
    deadline = time.monotonic() + EXIT_WAIT_S
    for got in copying:
        got.wait(timeout=max(0.0, deadline - time.monotonic()))
        got.stop_waiting()  # a hold kept for late readers goes with this process: freed now


_copying: list = []
#: How long an exiting process finishes a copy it still makes.
EXIT_WAIT_S = 30.0


def _register_at_exit() -> None:
    """Run :func:`_at_exit` when the main thread ends, before ``concurrent.futures`` shuts its
    pools: from then on they refuse new work, and a copy still being made would fail mid-way
    (seen: a ``.failed`` note left on the node, its other readers streaming from the store).
    Threading's exit hooks run last-registered first, and that module's was registered at its
    import, before this one. Where CPython has no such hook, ``atexit`` (run after it)."""
    import concurrent.futures.thread  # noqa: F401  (its hook registered first, so it runs after ours)

    hook = getattr(threading, "_register_atexit", None)
    if hook is not None:
        try:
            hook(_at_exit)
            return
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(_at_exit)


_register_at_exit()


@fail_open("releasing the node relay copy", fallback="the copy is freed when this process exits")
def engine_ready(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    with _lock:
        if not _held:
            raise NotApplicable("no relay copy held in this process")
    try:
        return original(*args, **kwargs)
    finally:
        release_all()
