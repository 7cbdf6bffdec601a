"""Helpers every bench scenario shares: the cleanup-on-signal handler, side-by-side ratios, a
process's own memory, a directory's bytes, and the results' and server's end of a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional


def raise_on_signal(signum: int, _frame: Any) -> None:
    """Install for SIGTERM/SIGHUP so a bench's ``finally`` cleanup (servers, temp dirs) runs."""
    raise SystemExit(128 + signum)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """*a* / *b*, or None when either side is missing (a failed run is never a ratio)."""
    return None if a is None or not b else a / b


def rss_bytes(pid: int) -> int:
    """The RSS of *pid* in bytes without its shared-memory pages (0 once it is gone): a reader's
    tensors map the relay copy's pages, which the copy's own size already counts."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssShmem:")):
                    name, value = line.split()[:2]
                    fields[name] = int(value) * 1024
    except OSError:
        pass
    return max(0, fields.get("VmRSS:", 0) - fields.get("RssShmem:", 0))


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under *path* (their sizes), 0 when it is gone."""
    from ray_runai_shim.snapshot.relay import tree_bytes

    return tree_bytes(path)


def write_results(path: Path, data: dict[str, Any], doc: Optional[Path] = None, begin: str = "", end: str = "",
                  block: str = "") -> None:
    """The run's JSON at *path*; with *doc*, its generated block between *begin* and *end* too."""
    import bench_docs

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {path}")
    if doc is not None:
        bench_docs.write_block(doc, begin, end, block)
        print(f"rewrote the {begin} block of {doc}")


def stop_and_clean(server: Any, workdir: Path) -> None:
    """The end of every run, failed or not: the store server stopped, the scratch dir gone."""
    if server is not None:
        server.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"cleaned up s3rver and {workdir}", flush=True)
