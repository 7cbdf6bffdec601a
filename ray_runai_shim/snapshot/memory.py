"""How much memory this node (or this container) can still give: the relay's copy and the
streamer's buffers must fit in it together, never push the node into OOM.

Read from the kernel, never assumed: ``MemAvailable`` from ``/proc/meminfo``, the
container's limit from cgroup v2 (``memory.max`` - ``memory.current``) or v1
(``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), and the free space of the
memory-backed filesystem the relay writes to (``statvfs``; tmpfs pages count against
the cgroup too). Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional

CGROUP = Path("/sys/fs/cgroup")
#: Kept free for everything else on the node (the engines' own RSS, Ray, the OS).
HEADROOM_BYTES = 1 << 30
#: The streamer's own host-memory default per process group (runai-model-streamer 0.17.x).
STREAMER_DEFAULT_LIMIT = 40 * 10**9
#: ``RUNAI_STREAMER_MEMORY_LIMIT=0``: the streamer's own minimal mode, one buffer of its largest
#: read (one tensor). The least any reader can use; what a share below that largest tensor gets.
MINIMAL = 0
#: The floor assumed when the checkpoint's largest tensor is not known (doctor): the embeddings
#: of 70B-class models are 1-2 GB.
UNKNOWN_LARGEST_BYTES = 2 << 30
#: The buffer of a reader of the node relay's local copy where the user set none. Local memory
#: needs no deep read-ahead: the streamer's default buffers the whole checkpoint per reader, and
#: allocating and faulting that in is what a local load spends its time on. Measured (``./dev
#: bench nodes``, 1 GiB, 2 and 4 readers of one /dev/shm copy, docs/node-relay.md): all ready in
#: 0.93-0.94x the default's time behind a 40 MB/s link, at 0.48-0.54x the node's peak memory.
LOCAL_READ_BYTES = 256 << 20


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < (1 << 60) else None  # v1 says "no limit" with a huge number


def _own_paths(proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[str, str]:
    """This process's cgroup paths: (v2 unified, v1 memory controller)."""
    v2 = v1 = ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            ident, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if ident == "0" and not controllers:
                v2 = path.strip().lstrip("/")
            elif "memory" in controllers.split(","):
                v1 = path.strip().lstrip("/")
    except OSError:
        pass
    return v2, v1


def _tightest(top: Path, rel: str, limit_file: str, usage_file: str) -> Optional[int]:
    """The smallest (limit - usage) from *top*/*rel* up to *top*: a parent's limit binds too."""
    best: Optional[int] = None
    d = top / rel if rel else top
    while True:
        limit = _read_int(d / limit_file)
        if limit is not None:
            room = max(0, limit - (_read_int(d / usage_file) or 0))
            best = room if best is None else min(best, room)
        if d == top or top not in d.parents:
            return best
        d = d.parent


def cgroup_room(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Optional[int]:
    """Bytes the container may still use (its tightest limit minus usage); None without a limit."""
    v2_rel, v1_rel = _own_paths(proc_cgroup)
    if (root / "cgroup.controllers").exists() or (root / "memory.max").exists():
        return _tightest(root, v2_rel, "memory.max", "memory.current")
    return _tightest(root / "memory", v1_rel, "memory.limit_in_bytes", "memory.usage_in_bytes")


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fs_free(path: Path) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Room(NamedTuple):
    available: Optional[int]  # MemAvailable
    cgroup: Optional[int]  # the container's limit minus its usage, None without a limit
    filesystem: Optional[int]  # free bytes where the relay writes

    def usable(self) -> int:
        """What a new allocation may take: the smallest of the three, less the headroom."""
        known = [v for v in (self.available, self.cgroup, self.filesystem) if v is not None]
        if not known:
            return 0
        return max(0, min(known) - HEADROOM_BYTES)

    def describe(self) -> str:
        def gib(v: Optional[int]) -> str:
            return "n/a" if v is None else f"{v / (1 << 30):.1f} GiB"

        return (f"MemAvailable {gib(self.available)}, container room {gib(self.cgroup)}, "
                f"free in the relay dir {gib(self.filesystem)}")


def room(where: Path) -> Room:
    return Room(mem_available(), cgroup_room(), fs_free(where))


def reader_budget(readers: int, usable: int, largest: Optional[int] = None,
                  total: Optional[int] = None) -> Optional[int]:
    """``RUNAI_STREAMER_MEMORY_LIMIT`` for each of *readers* sharing *usable* bytes.

    None when the streamer's default already fits (a share of at least 40 GB, or of the whole
    checkpoint, *total*, which is all the default buffers); the share when it holds the largest
    tensor (*largest*; :data:`UNKNOWN_LARGEST_BYTES` when not known), since the streamer refuses
    a limit below it; else :data:`MINIMAL`, one buffer of the largest tensor.
    """
    share = usable // max(1, readers)
    if share >= STREAMER_DEFAULT_LIMIT or (total is not None and share >= total):
        return None
    return share if share >= (largest or UNKNOWN_LARGEST_BYTES) else MINIMAL


def local_read_limit(budget: Optional[int], largest: int, total: int) -> Optional[int]:
    """The limit of a reader of a local copy: *budget* (None: the default fits) capped at
    :data:`LOCAL_READ_BYTES`, or at the *largest* tensor where that is bigger (the least the
    streamer accepts). None where the cap would not bind (a checkpoint of *total* bytes no
    bigger than it: the default buffers no more than that)."""
    if budget == MINIMAL:
        return MINIMAL
    cap = max(LOCAL_READ_BYTES, largest)
    if cap >= total:
        return budget
    return cap if budget is None else min(budget, cap)
