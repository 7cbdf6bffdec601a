"""The streamer's memory on a node: one budget shared by its readers, and limits it can read.

Where the user has not bounded the streamer's host memory (``RUNAI_STREAMER_MEMORY_LIMIT`` or
``model_loader_extra_config["memory_limit"]``), the readers on the node share one budget taken
from the node's and the container's free memory (:mod:`..snapshot.memory`): N readers at the
streamer's default 40 GB each can no longer push the node into OOM. Readers of the relay's copy
get a smaller buffer still (local memory needs no deep read-ahead; it loads faster). The limit
travels in the engine's load config too, so ranks of vLLM's Ray executor get it. A limit the
streamer cannot read is named before the engine starts (:func:`check_memory_limit`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import ShimError
from ..log import human_bytes, logger
from ..snapshot import headers, memory, relay_cluster
from ..tables import settings
from ..tables.support import is_remote_uri

MEMORY_LIMIT = settings.STREAMER_MEMORY_LIMIT
#: The streamer's per-request timeout (default 1000 ms). Measured through a link that stalls (bench
#: notes, docs/node-relay.md): a stall over ~5 s made the default re-request ranges (+27 % bytes from
#: the store, still finishing); 30 s re-requested nothing. Set only where the user has not.
REQUEST_TIMEOUT = settings.STREAMER_REQUEST_TIMEOUT
REQUEST_TIMEOUT_MS = "30000"


def loader_extra(engine_args: Any) -> dict:
    extra = getattr(engine_args, "model_loader_extra_config", None) or {}
    return extra if isinstance(extra, dict) else {}


def user_memory_limit(engine_args: Any) -> bool:
    return bool(os.environ.get(MEMORY_LIMIT)) or loader_extra(engine_args).get("memory_limit") is not None


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


def set_budget(readers: int, weights: str, fs_and_path: FsAndPath = None, local: Optional[bool] = None
               ) -> Optional[int]:
    """Give this process's streamer (and the ranks it starts, which inherit the environment)
    its share of the node's memory for *readers* readers of *weights*; measured after the
    relay's copy is in place, so the copy and the buffers fit together. Readers of the relay's
    local copy (*weights* a local path) also get a smaller buffer: local memory needs no deep
    read-ahead (:data:`..snapshot.memory.LOCAL_READ_BYTES`). One reader alone keeps the
    streamer's default (as without the shim: no request, no setting). Returns the limit set."""
    if readers < 2:
        return None
    if local is None:  # readers of a relay copy still being made: local, though its files are not all there
        local = not is_remote_uri(weights)
    room = memory.room(Path("/dev/shm"))
    usable = room.usable()
    checkpoint, held = None, 0
    capacity = relay_cluster.object_store_capacity()  # 0 outside a cluster of two or more nodes
    if capacity:  # Ray's object store may hold the model for the other nodes, in this memory
        checkpoint = _checkpoint(weights, fs_and_path)
        held = relay_cluster.object_store_share(checkpoint[0], capacity)
        usable = max(0, usable - held)
    budget = memory.reader_budget(readers, usable)
    if budget is None and not local:
        return None  # 40 GB each fits: nothing to read
    total, largest_of = checkpoint or _checkpoint(weights, fs_and_path)
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
        shared = f"; {human_bytes(held)} left to Ray's object store for the other nodes" if held else ""
        logger.info("ray-runai-shim: streamer memory budget %s per reader (%d readers on this node; %s%s)",
                    human_bytes(budget), readers, room.describe(), shared)
    return budget


def budget_to_ranks(config: Any, budget: int) -> None:
    """Carry *budget* in the engine's load config (``model_loader_extra_config["memory_limit"]``,
    which vLLM's runai loader turns into ``RUNAI_STREAMER_MEMORY_LIMIT`` in the process that
    loads): ranks of vLLM's Ray executor are Ray workers that never see this process's
    environment, and the config reaches every rank whatever the executor."""
    load_config = getattr(config, "load_config", None)
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    if load_config is not None and isinstance(extra, dict):
        object.__setattr__(load_config, "model_loader_extra_config", {**extra, "memory_limit": budget})


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
                       ('model_loader_extra_config["memory_limit"]', loader_extra(engine_args).get("memory_limit"))):
        if raw is None or _readable_limit(raw):
            continue
        raise ShimError(
            f"ray-runai-shim: {where}={raw!r} is not a limit the Run:ai streamer can read: it takes a whole number "
            "of bytes (e.g. 4000000000 for 4 GB; 0: one tensor at a time; -1: no limit), no units, and would fail "
            f"on {raw!r} only once the engine loads its weights. Fix: set it to a number of bytes, or unset it "
            "and the shim shares the node's memory among its readers.")


def budget_quietly(config: Any, readers: int, weights: str, local: Optional[bool] = None) -> None:
    try:
        budget = set_budget(readers, weights, local=local)
        if budget is not None:
            budget_to_ranks(config, budget)
    except Exception:  # a budget not set must not stop the engine: the streamer's default stays
        logger.warning("ray-runai-shim: could not work out the streamer memory budget for %s; the streamer "
                       "keeps its default limit", weights, exc_info=True)
