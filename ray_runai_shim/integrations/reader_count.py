"""How many readers of one model share this node: the ranks of each engine times the engines.

The node relay pays off only where two or more readers on one node load the same checkpoint
(:mod:`.engine_relay` asks :func:`readers_on_node`), and the streamer budget is a node's memory shared
among them (:mod:`.relay_budget`). Every front-end says it its own way: Ray Data's stage through
``RAY_RUNAI_SHIM_NODE_ENGINES`` (set by :func:`.engine_relay.stage_init`), a Serve replica through its
deployment's size, vLLM's Ray executor through its placement group.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from ..snapshot import relay as node_relay
from ..snapshot import relay_cluster
from ..tables import settings


def readers_on_node(engine_args: Any) -> int:
    """The ranks of this engine (TP x PP; all on this node unless Ray places them) times the
    engines of this model per node: ``RAY_RUNAI_SHIM_NODE_ENGINES`` (set by the user, or by the
    shim on Ray Data's stage), else a Serve replica's deployment size spread over the nodes."""
    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(engine_args, "pipeline_parallel_size", 1) or 1)
    return tp * pp * engines_on_node()


def engines_on_node() -> int:
    """The engines of this model planned per node (each engine's ranks read its copy)."""
    engines = settings.count(settings.NODE_ENGINES, 0, low=1)
    if not engines:
        replicas = serve_replicas()
        engines = engines_per_node(replicas) if replicas else 1
    return engines


def engines_to_wait_for() -> int:
    """The engines a node's copy waits for once its present readers have loaded
    (:func:`..snapshot.relay.release`): a Serve deployment's replicas on this node -- they are
    started together and live on. Not Ray Data's: an autoscaling pool may never start its
    largest size, and the dataset's end kills its actors, a hold included, without a sweep."""
    return engines_on_node() if serve_replicas() else 1


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


def stage_engines(map_batches_kwargs: dict) -> int:
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
    nodes, here = _placement_nodes()
    return bool(nodes) and nodes == {here}


def ranks_span_nodes() -> bool:
    """This process is a rank of an engine whose ranks Ray placed on two or more nodes (vLLM's Ray
    executor: its placement group's bundles are on several nodes), in a cluster that relays
    between nodes. The engine's process cannot relay for such ranks (a copy in its node's memory
    means nothing to a rank on another node): each rank relays on its own node instead."""
    return cluster_relays() and len(_placement_nodes()[0]) >= 2


def _placement_nodes() -> tuple[set, Optional[str]]:
    """(the nodes of the placement group this process runs in -- empty outside one -- and this
    node's id), or (empty, None) where Ray cannot say."""
    try:
        import ray

        pg = ray.util.get_current_placement_group()
        if pg is None:
            return set(), None
        nodes = set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values())
        return nodes, ray.get_runtime_context().get_node_id()
    except Exception:
        return set(), None


def relay_wanted(readers: int) -> bool:
    mode = node_relay.mode()
    return mode == "on" or (mode == "auto" and readers >= 2)


def relay_for_the_cluster(readers: int, pipelined: bool) -> bool:
    """One reader on the node, yet relayed: in a Ray cluster of two or more nodes the node copy
    is how nodes take the weights from each other (:mod:`..snapshot.relay_cluster`). Only where
    the ranks read the copy as it lands: one reader waiting for a whole copy would lose time."""
    return readers < 2 and pipelined and cluster_relays()


def cluster_relays() -> bool:
    """The node relay is on its own rule (``auto``) and this process is in a Ray cluster of two
    or more nodes that shares copies (:mod:`..snapshot.relay_cluster`)."""
    return node_relay.mode() == "auto" and relay_cluster.wanted()
