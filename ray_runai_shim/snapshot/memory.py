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


def _own_cgroup_v2(root: Path) -> Path:
    """The v2 cgroup this process is in (``0::/path`` in /proc/self/cgroup)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().lstrip("/")
                candidate = root / rel
                if (candidate / "memory.max").exists():
                    return candidate
    except OSError:
        pass
    return root


def cgroup_room(root: Path = CGROUP) -> Optional[int]:
    """Bytes the container may still use (limit minus usage); None when it has no limit."""
    v2 = _own_cgroup_v2(root)
    limit = _read_int(v2 / "memory.max")
    if limit is not None:
        used = _read_int(v2 / "memory.current") or 0
        return max(0, limit - used)
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    if limit is not None:
        used = _read_int(root / "memory" / "memory.usage_in_bytes") or 0
        return max(0, limit - used)
    return None


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
