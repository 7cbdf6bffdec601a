"""One store read per Ray cluster: node relays take the weights from each other through Ray's
object store.

The node relay reads the store once per node, so M nodes read M x S. Here the first node to
copy a model (the *source*) also puts each range it has verified into Ray's object store, and
the relay of every other node (a *peer*) pulls those ranges node to node with Ray's own object
transfer, as they arrive, into its node copy: its readers start on them as on any copy
(:mod:`.relay_read`). A small named actor (:class:`Registry`, one per cluster, owned by the job
that made it) says who the source is and holds the ranges' references; it owns the objects
(``ray.put(_owner=...)``), so they live while it does, not while the source's process does;
it is detached and leaves by itself once it has held nothing for ``IDLE_EXIT_S``.

What it guarantees, with the node relay's key rules (the key holds every object's version and
the reading account: only a node that listed the same versions, as the same account, shares):

* no weight byte on disk: ranges are put only where the model fits under half of the source
  node's object store and the node's memory holds the copy and the objects both, so Ray's store
  stays below its spilling threshold for them; peers drop each range as soon as it is written
  (a secondary copy, evicted, never spilled); the registry lets go of every range once the
  source and every peer that joined have their copies, after ``RAY_RUNAI_SHIM_RELAY_WAIT``
  (120 s) for late nodes;
* nothing torn or stale: a range is offered only after the source verified it; a peer ends with
  the node relay's own last check (every object's identity read again);
* faults cost time, never the model: a source gone, a range lost or evicted, a transfer that
  stalls for ``PULL_STALL_S`` -- the peer says so in one WARNING and copies the rest from the
  store (its record keeps what it had). A source that cannot put (too little object store or
  memory) says so once and copies for itself; another node may then be the source.

``RAY_RUNAI_SHIM_CLUSTER_RELAY`` (``auto``: on in a Ray cluster of two or more nodes; ``off``).
Nothing changes in a cluster of one node, or in a process without Ray.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from ..log import human_bytes, logger
from ..tables import settings
from . import relay_progress

CLUSTER_RELAY = settings.CLUSTER_RELAY
NAME = "ray-runai-shim-cluster-relay"
NAMESPACE = "ray-runai-shim"
#: A peer that receives no new range for this long copies the rest from the store.
PULL_STALL_S = 30.0
#: The source says it is alive this often while it copies, from a thread of its own (a copy
#: loop waiting on the store or on Ray's object store is not a dead process); silent for
#: SOURCE_SILENT_S, it is taken for gone (its process died): its peers read the rest from the
#: store, and the next node to claim the model copies it.
BEAT_S = 2.0
SOURCE_SILENT_S = 10.0
#: How long the registry keeps a model's ranges after the source and every peer have theirs,
#: for nodes that start later (``RAY_RUNAI_SHIM_RELAY_WAIT``, as the node relay waits for its own).
LINGER_S = 120.0
#: Ranges are put in pieces of at most this many bytes; a peer pulls this many at once.
PIECE_BYTES = 8 << 20
PULL_AT_ONCE = 8
#: The model must fit under this share of the source node's object store (Ray spills objects
#: only above its threshold, 0.8 by default: half leaves room for everything else).
STORE_SHARE = 0.5
CALL_TIMEOUT_S = 30.0
#: The first claim on a node waits for the registry's actor to start: a new worker process,
#: which on a loaded node (engines starting beside it) took longer than CALL_TIMEOUT_S.
CLAIM_TIMEOUT_S = 120.0
#: The registry leaves once it has held no model for this long.
IDLE_EXIT_S = 120.0


def linger_s() -> float:
    """How long a copy waits for late readers: the registry's ranges for later nodes, and a node
    copy for its node's later Serve replicas (:func:`.relay.release`). ``RAY_RUNAI_SHIM_RELAY_WAIT``,
    else :data:`LINGER_S`."""
    return settings.seconds(settings.RELAY_WAIT, LINGER_S)


def mode() -> str:
    """``auto`` (share in a cluster of two or more nodes) or ``off``."""
    return settings.choice(CLUSTER_RELAY, ("auto", "off"), "auto")


def _ray() -> Any:
    """Ray, when this process is part of a Ray cluster of two or more nodes (else None)."""
    if mode() == "off":
        return None
    ray = sys.modules.get("ray")  # never imported here: a process that has not imported Ray is in no cluster
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    return ray


def alive_nodes() -> list[dict]:
    ray = _ray()
    if ray is None:
        return []
    return [n for n in ray.nodes() if n.get("Alive")]


def wanted() -> bool:
    """Whether this process shares copies with other nodes: Ray is up with two or more nodes."""
    try:
        return len(alive_nodes()) >= 2
    except Exception:  # a GCS hiccup: the node relay alone
        return False


def _capacity(nodes: list[dict], node: str) -> float:
    return next((n.get("Resources", {}).get("object_store_memory", 0) for n in nodes if n.get("NodeID") == node), 0)


def object_store_capacity() -> float:
    """This node's object store size where this process is in a cluster of two or more nodes
    (else 0: nothing is shared)."""
    try:
        nodes = alive_nodes()
        if len(nodes) < 2:
            return 0
        return _capacity(nodes, _ray().get_runtime_context().get_node_id())
    except Exception:
        return 0


def object_store_share(nbytes: int, capacity: Optional[float] = None) -> int:
    """What Ray's object store on this node may come to hold for the cluster relay of a model of
    *nbytes*: the whole model where this node shares it (it fits under ``STORE_SHARE`` of the
    node's object store, *capacity* -- asked of Ray when not given), else nothing; 0 outside a
    cluster. The object store lives in the same memory as the node copy and the streamer's
    buffers (``/dev/shm``), so the streamer's budget leaves it out
    (:func:`..integrations.relay_budget.set_budget`)."""
    capacity = object_store_capacity() if capacity is None else capacity
    return nbytes if capacity and nbytes <= STORE_SHARE * capacity else 0


class Registry:
    """Who copies which model, and the ranges it has verified (held here, so they outlive it).

    A threaded actor: peers block in :meth:`ranges` until there is something new."""

    def __init__(self) -> None:
        self.models: dict[str, dict] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._reaper, daemon=True, name="rrs-cluster-reaper").start()

    def claim(self, key: str, node: str) -> dict:
        """The first node to claim *key* copies it from the store (the source); the others take
        it from there (peers), while it copies and for ``LINGER_S`` after."""
        with self.cond:
            m = self.models.get(key)
            stale = m is not None and m["state"] == "copying" and time.monotonic() - m["last"] > SOURCE_SILENT_S
            if m is None or m["state"] == "failed" or stale:  # a source that stopped, or went silent
                self.models[key] = {"source": node, "state": "copying", "items": [], "peers": set(),
                                    "finished": set(), "bytes": 0, "idle_since": None, "why": "",
                                    "last": time.monotonic()}
                return {"role": "source"}
            if m["source"] == node:  # the node's fetcher died and another process there resumes its copy
                return {"role": "source"}
            m["peers"].add(node)
            m["idle_since"] = None
            return {"role": "peer", "source": m["source"]}

    def offer(self, key: str, items: list) -> None:
        with self.cond:
            m = self.models.get(key)
            if m is None:
                return
            m["items"].extend(items)
            m["bytes"] += sum(e - s for _f, s, e, _r in items)
            m["last"] = time.monotonic()
            self.cond.notify_all()

    def beat(self, key: str) -> None:
        """The source is alive and copying, with nothing new to offer yet."""
        with self.cond:
            m = self.models.get(key)
            if m is not None:
                m["last"] = time.monotonic()

    def ranges(self, key: str, since: int, wait_s: float) -> tuple[list, str, str]:
        """The ranges offered after the first *since* (waiting up to *wait_s* for one), the
        model's state, and why its source stopped sharing, if it did (or went silent)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                m = self.models.get(key)
                if m is None:
                    return [], "gone", "its registry entry expired"
                if len(m["items"]) > since or m["state"] != "copying":
                    return m["items"][since:], m["state"], m["why"]
                silent = time.monotonic() - m["last"]
                if silent > SOURCE_SILENT_S:
                    return [], "silent", f"the node copying it has said nothing for {silent:.0f} s (its process is gone?)"
                left = deadline - time.monotonic()
                if left <= 0:
                    return [], m["state"], ""
                self.cond.wait(min(left, 1.0))

    def finish(self, key: str, node: str, ok: bool, why: str = "") -> None:
        with self.cond:
            m = self.models.get(key)
            if m is None:
                return
            if node == m["source"]:
                if not ok:  # its objects go now; peers copy the rest from the store, told why
                    m.update(state="failed", why=why or "its copy failed", items=[], idle_since=time.monotonic())
                    self.cond.notify_all()
                    return
                m["state"] = "done"
            else:
                m["finished"].add(node)
            self._mark_idle(m)
            self.cond.notify_all()

    def _mark_idle(self, m: dict) -> None:
        if m["state"] == "done" and m["peers"] <= m["finished"]:
            m["idle_since"] = m["idle_since"] or time.monotonic()

    def status(self) -> list[dict]:
        with self.cond:
            return [{"key": k, "source": m["source"], "state": m["state"], "bytes": m["bytes"],
                     "peers": sorted(m["peers"]), "finished": sorted(m["finished"])} for k, m in self.models.items()]

    def _reaper(self) -> None:
        empty_since = time.monotonic()
        while True:
            time.sleep(1.0)
            with self.cond:
                now, linger = time.monotonic(), linger_s()
                for key in [k for k, m in self.models.items()
                            if m["idle_since"] is not None and now - m["idle_since"] >= linger]:
                    self.models.pop(key, None)  # the last references: Ray frees the objects
                if self.models:
                    empty_since = now
                    continue
            if now - empty_since >= IDLE_EXIT_S:  # detached: it leaves once it has held nothing for a while
                _exit_actor()
                return


def _exit_actor() -> None:
    """End the registry's actor; nothing at all where this is not an actor (a test's registry)."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return
    except Exception:
        return
    try:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    except Exception:
        os._exit(0)  # inside the registry's own actor process only (checked above)


def registry(ray: Any) -> Any:
    """The cluster's registry actor, made by the first caller. Detached: it belongs to no process
    (a source whose task or replica ends must not take the others' ranges with it); it leaves by
    itself once it has held nothing for ``IDLE_EXIT_S``."""
    actor = ray.remote(num_cpus=0, max_concurrency=64)(Registry)
    node = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return actor.options(name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote()


class Share:
    """This node's part in sharing one model's copy: the ``source`` puts what it verified, a
    ``peer`` pulls it. Every Ray error becomes one WARNING and the node relay's own way."""

    def __init__(self, ray: Any, actor: Any, key: str, uri: str, role: str, node: str, source: str = "",
                 fits: Optional[Callable[[], str]] = None) -> None:
        self.ray, self.actor, self.key, self.uri, self.role = ray, actor, key, uri, role
        self.node, self.source = node, source
        self.pulled = 0
        self._fits = fits  # "" when the source may put the model into Ray's object store, else why not
        self._checked = False
        self._sent: dict[str, relay_progress.Intervals] = {}
        self._broken = False
        self._done = threading.Event()  # stops the source's beat

    def start(self) -> None:
        """As the source: say it is alive every ``BEAT_S`` from a thread of its own until the
        copy ends (:meth:`finish`) or sharing stops; it dies with the process, which is what
        the silence means."""
        if self.role != "source":
            return

        def run() -> None:
            while not self._done.wait(BEAT_S):  # set by every way a source stops sharing or ends
                try:
                    self.actor.beat.remote(self.key)
                except Exception:
                    return

        threading.Thread(target=run, name="rrs-cluster-beat", daemon=True).start()

    # -- the source ------------------------------------------------------------------------
    def offer(self, publisher: relay_progress.Publisher, read: Callable[[str, int, int], bytes]) -> None:
        """Put every verified range not put yet into Ray's object store (owned by the registry),
        for the nodes that take the model from this one now or within ``LINGER_S``."""
        if self.role != "source" or self._broken or not self._may_put():
            return
        try:
            import numpy as np

            items = []
            for name, intervals in publisher.done.items():
                sent = self._sent.setdefault(name, [])
                for s, e in intervals:
                    for off in range(s, e, PIECE_BYTES):
                        end = min(e, off + PIECE_BYTES)
                        if relay_progress.covers(sent, off, end):
                            continue
                        ref = self.ray.put(np.frombuffer(read(name, off, end - off), dtype=np.uint8),
                                           _owner=self.actor)
                        items.append((name, off, end, [ref]))  # in a list: handed on as a reference
                        self._sent[name] = sent = relay_progress.add(sent, off, end)
            if items:  # waited for: the registry must hold every range before it hears the copy is done
                self.ray.get(self.actor.offer.remote(self.key, items), timeout=CALL_TIMEOUT_S)
        except Exception as e:
            self._stop_sharing(f"putting it into Ray's object store failed ({_why(e)})")

    def _may_put(self) -> bool:
        """Whether the model fits in Ray's object store here (asked once; when not, the other
        nodes read the store, and this one says why at INFO: nobody may have wanted it)."""
        if not self._checked:
            self._checked = True
            why = self._fits() if self._fits is not None else ""
            if why:
                self._broken = True
                logger.info("ray-runai-shim: cluster relay: not sharing %s with the other nodes: %s", self.uri, why)
                self._tell_stopped(why)
                return False
        return True

    def _stop_sharing(self, why: str) -> None:
        self._broken = True
        logger.warning("ray-runai-shim: cluster relay: this node stops sharing %s with the other nodes: %s; they "
                       "read the store for the rest", self.uri, why)
        self._tell_stopped(why)

    def _tell_stopped(self, why: str) -> None:
        self._done.set()
        try:
            self.actor.finish.remote(self.key, self.node, False, why)
        except Exception:
            pass

    # -- a peer ----------------------------------------------------------------------------
    def pull(self, publisher: relay_progress.Publisher, fds: dict[str, int]) -> bool:
        """Copy the source's ranges into this node's copy as they arrive (published as verified:
        the source verified them, and its key names the same versions). True when the copy is
        whole; False after one WARNING: the caller copies the rest from the store."""
        since = 0
        started = last = time.monotonic()
        try:
            while publisher.bytes_done < publisher.total:
                items, state, why = self.ray.get(self.actor.ranges.remote(self.key, since, 2.0),
                                                 timeout=CALL_TIMEOUT_S)
                since += len(items)
                todo = [it for it in items if not relay_progress.covers(publisher.done.get(it[0], []), it[1], it[2])]
                for i in range(0, len(todo), PULL_AT_ONCE):
                    batch = todo[i:i + PULL_AT_ONCE]
                    arrays = self.ray.get([refs[0] for _n, _s, _e, refs in batch], timeout=PULL_STALL_S)
                    for (name, s, e, _refs), arr in zip(batch, arrays):
                        view = memoryview(arr).cast("B")
                        if len(view) != e - s:
                            raise RuntimeError(f"a range of {len(view)} bytes where {e - s} were offered")
                        n = 0
                        while n < len(view):
                            n += os.pwrite(fds[name], view[n:], s + n)
                        publisher.written(name, s, e)
                        self.pulled += e - s
                    del arrays  # the local secondary copies: evicted, never spilled
                    publisher.verified(publisher.take_written())
                    last = time.monotonic()
                if todo:
                    continue
                if state in ("gone", "failed", "silent") or (state == "done" and not items):
                    if publisher.bytes_done < publisher.total:
                        self._give_up(f"the node copying it stopped sharing: {why or state}")
                        return False
                if time.monotonic() - last >= PULL_STALL_S:
                    self._give_up(f"no range arrived from its node for {PULL_STALL_S:.0f} s")
                    return False
            logger.info("ray-runai-shim: cluster relay: took %s of %s from node %s through Ray's object store in "
                        "%.2f s", human_bytes(self.pulled), self.uri, self.source[:12], time.monotonic() - started)
            return True
        except Exception as e:
            self._give_up(_why(e))
            return False

    def _give_up(self, why: str) -> None:
        self._broken = True
        logger.warning("ray-runai-shim: cluster relay: taking %s from another node stopped (%s); this node reads "
                       "the rest from the store", self.uri, why)

    def finish(self, ok: bool) -> None:
        """This node's copy is whole (*ok*) or given up; a source that stopped sharing said so."""
        self._done.set()
        if self.role == "source" and self._broken:
            return
        try:
            self.actor.finish.remote(self.key, self.node, ok, "" if ok else "its copy from the store failed")
        except Exception:
            pass


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def join(key: str, uri: str, nbytes: int, room: Callable[[], int]) -> Optional[Share]:
    """This node's part for the copy of *key*, or None (no cluster, sharing off, or Ray said
    no: the node relay copies from the store). *room*: what the node's memory can
    take beyond the copy itself, asked when another node wants the model."""
    ray = _ray()
    if ray is None:
        return None
    try:
        nodes = alive_nodes()
        if len(nodes) < 2:
            return None
        node = ray.get_runtime_context().get_node_id()
        capacity = _capacity(nodes, node)
        actor = registry(ray)
        got = ray.get(actor.claim.remote(key, node), timeout=CLAIM_TIMEOUT_S)
    except Exception as e:
        logger.warning("ray-runai-shim: cluster relay: Ray cannot carry %s between nodes here (%s); this node reads "
                       "the store", uri, _why(e))
        return None
    role = got.get("role")
    if role is None:
        return None

    def fits() -> str:
        spare = room()
        if nbytes <= STORE_SHARE * capacity and nbytes <= spare:
            return ""
        return (f"{human_bytes(nbytes)} does not fit under half of this node's object store "
                f"({human_bytes(int(capacity))}) beside the node copy ({human_bytes(max(0, spare))} of memory to "
                f"spare; give Ray a larger object store, or set {CLUSTER_RELAY}=off)")

    share = Share(ray, actor, key, uri, role, node, got.get("source", ""), fits=fits)
    share.start()
    if role == "peer":
        logger.info("ray-runai-shim: cluster relay: taking %s from node %s through Ray's object store", uri,
                    share.source[:12])
    else:
        logger.info("ray-runai-shim: cluster relay: this node reads %s from the store and shares it with the other "
                    "nodes through Ray's object store", uri)
    return share
