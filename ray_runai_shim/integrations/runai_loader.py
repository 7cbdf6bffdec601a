"""vLLM's runai loader, in each rank: start on the relay copy's bytes already on the node.

The engine's process hands vLLM the node relay's copy as ``model_weights``
(:mod:`.engine_relay`); a rank of an engine whose ranks span nodes is handed the store's URI,
and takes it through its own node's relay (:func:`_relay_here`: the cluster reads it once). While that copy is still being made, each rank reads every tensor as soon
as its bytes are on the node and verified (:mod:`..snapshot.relay_read`), instead of waiting
for the whole copy: a node is ready after about max(copy, load), not copy + load. Wrapped:
``RunaiModelStreamerLoader._get_weights_iterator`` (the loader's one door to the weights; vLLM
copies each tensor into its parameter whatever the order). A complete copy is left to vLLM,
which streams its files with the user's ``runai_streamer`` format. Should the copy
fail or stall, the rank streams the whole checkpoint from the store with vLLM's own iterator
(every tensor again: whatever it had read is overwritten by one version), after one WARNING.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from ..failopen import NotApplicable, fail_open
from ..log import logger
from ..snapshot import relay as node_relay
from ..snapshot import relay_read
from ..snapshot.handoff import UNSIGNED
from ..tables.support import is_remote_uri, join_anonymous
from .reader_count import ranks_span_nodes


def relay_copy_path(path: Any) -> bool:
    """Whether *path* names a copy in this user's node relay directory."""
    if not isinstance(path, str) or not os.path.isabs(path):
        return False
    return Path(path).parent == node_relay.root()


def _visible() -> None:
    """A vLLM process that never imported Ray has no handler for the shim's lines: give it one
    (stderr, which the engine's log collects), so what a rank waits for is seen."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


@fail_open("reading the node relay's copy as it lands", fallback="vLLM reads the copy's files")
def weights_iterator(original: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    path = args[0] if args else kwargs.get("model_or_path")
    if (isinstance(path, str) and is_remote_uri(path) and not getattr(instance, "_is_distributed", False)
            and ranks_span_nodes()):
        return _relay_here(path, original, args, kwargs)
    if not relay_copy_path(path):
        raise NotApplicable("not a node relay copy")
    live = relay_read.open_live(Path(path))
    _visible()
    if live is None:
        logger.info("ray-runai-shim: node relay: this rank streams the whole copy %s (pid %d)", path, os.getpid())
        raise NotApplicable("the copy is complete: vLLM streams its files")
    logger.info("ray-runai-shim: node relay: this rank reads %s as its copy lands (pid %d)", live.uri, os.getpid())
    return as_it_lands(live, original, args, kwargs)


def _relay_here(uri: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """A rank of an engine spread over nodes (multi-node TP/PP): take the weights through this
    node's relay, which shares them with the other nodes' (:mod:`..snapshot.relay_cluster`): the
    cluster reads the store once, each node's ranks read node memory. No copy: stream, as vLLM."""
    _visible()
    unsigned = os.environ.get(UNSIGNED) == "1"
    try:  # runs once vLLM iterates, after fail_open returned: a shim bug here must not fail the load
        got = node_relay.acquire(join_anonymous(uri) if unsigned else uri, pipelined=True)
    except Exception:
        logger.warning("ray-runai-shim: node relay: this rank could not use its node's relay (a shim bug; please "
                       "report it); it streams %s from the store", uri, exc_info=True)
        got = None
    if got is None:  # acquire said why (one WARNING)
        yield from original(*args, **kwargs)
        return
    try:
        logger.info("ray-runai-shim: node relay: this rank of an engine spread over nodes reads %s through this "
                    "node's relay %s (pid %d)", uri, got.path, os.getpid())
        live = relay_read.open_live(got.path) if got.live else None
        if live is not None:
            yield from as_it_lands(live, original, args, kwargs)
        else:
            yield from _iterate(original, args, kwargs, str(got.path))
    finally:
        node_relay.release(got)


def as_it_lands(live: relay_read.LiveCopy, original: Callable[..., Any], args: tuple,
                kwargs: dict) -> Iterator[tuple[str, Any]]:
    """Every tensor of *live* as it lands; should the copy fail or stall, every tensor from the
    store with vLLM's own iterator (*original*, called with the source URI for the path)."""
    try:
        yield from live.tensors()
        return
    except relay_read.Unavailable as e:
        why, uri = e.why, e.uri or live.uri
    except Exception as e:  # a shim bug mid-load: the weights still come, from the store
        logger.warning("ray-runai-shim: node relay: reading the copy failed (a shim bug; please report it)",
                       exc_info=True)
        why, uri = f"{type(e).__name__}", live.uri
    if not uri:
        raise relay_read.Unavailable(f"the node relay's copy {live.final} cannot be read ({why}) and names no "
                                     "source to stream instead")
    logger.warning("ray-runai-shim: node relay: %s; this rank streams %s from the store instead (every tensor, "
                   "so the model is of one version)", why, uri)
    yield from _iterate(original, args, kwargs, uri)


def _iterate(original: Callable[..., Any], args: tuple, kwargs: dict, path: str) -> Iterator[tuple[str, Any]]:
    """vLLM's own iterator on *path* instead of the path it was called with."""
    if args:
        return original(path, *args[1:], **kwargs)
    return original(**{**kwargs, "model_or_path": path})
