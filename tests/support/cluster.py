"""A real Ray cluster started with ``ray start``, stopped without touching anyone else's Ray.

Ray's own stop command acts on every Ray process on the machine. Instead, every process of
this cluster inherits a unique marker in its environment (``RRS_TEST_CLUSTER``); stopping
sends SIGTERM, then SIGKILL, to exactly the processes that carry it (read from
``/proc/<pid>/environ``), so a developer's own Ray, or another test run, is left alone.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .servers import free_ports

RAY = str(Path(sys.executable).with_name("ray"))
MARKER = "RRS_TEST_CLUSTER"


def marked_pids(token: str) -> list[int]:
    """PIDs whose environment has ``RRS_TEST_CLUSTER=<token>`` (ours, by construction)."""
    needle = f"{MARKER}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def stop_marked(token: str, grace: float = 15.0) -> list[int]:
    """SIGTERM the marked processes, SIGKILL what is left after *grace* seconds."""
    pids = marked_pids(token)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and marked_pids(token):
        time.sleep(0.2)
    for pid in marked_pids(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class RayCluster:
    """``ray start --head`` (+ optional worker nodes) on 127.0.0.1 in a private temp dir."""

    def __init__(self, env: dict[str, str], *, dashboard: bool = False, root: Optional[Path] = None,
                 ray_bin: str = RAY) -> None:
        self.ray_bin = ray_bin  # another image's `ray` (tests/activation/test_deploy.py)
        self.root = root or Path(tempfile.mkdtemp(prefix="rrs-cl-", dir="/tmp"))
        self.token = uuid.uuid4().hex
        self.env = {**env, "HOME": str(self.root), MARKER: self.token}
        self.port, self.dashboard_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = dashboard
        if not dashboard:
            self.dashboard_port = None

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def ray(self, *args: str, env: Optional[dict[str, str]] = None,
            prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        proc = subprocess.run([*prefix, self.ray_bin, *args], env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def start_head(self, *extra: str, env: Optional[dict[str, str]] = None) -> RayCluster:
        # Every fixed default port (agents, metrics, client server) gets a free one: another cluster on
        # this machine (a developer's, a concurrent run) must not make ours lose its job agent.
        names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                 "runtime-env-agent-port", "ray-client-server-port")
        taken = frozenset(p for p in (self.port, self.dashboard_port) if p)
        ports = [f"--{name}={port}" for name, port in zip(names, free_ports(len(names), avoid=taken))]
        dash = ([f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1", "--include-dashboard=true"]
                if self.dashboard else ["--include-dashboard=false"])
        dash = [*dash, *ports]
        self.ray("start", "--head", f"--port={self.port}", f"--temp-dir={self.root / 't'}",
                 "--node-ip-address=127.0.0.1", *dash, *self._worker_ports(), *extra, env=env)
        return self

    @staticmethod
    def _worker_ports() -> list[str]:
        """A block of worker ports of this node's own, outside Ray's default 10002-19999 (which
        every local ``ray.init()`` of the other tests uses): two raylets on one machine handing
        out the same port made a driver's core worker fail to bind (``grpc_server.cc``)."""
        low = 20000 + 300 * random.randrange(40)
        return [f"--min-worker-port={low}", f"--max-worker-port={low + 299}"]

    def add_node(self, *extra: str, env: Optional[dict[str, str]] = None,
                 private: Sequence[Path] = (), make: Sequence[Path] = (), ip: str = "127.0.0.1") -> RayCluster:
        """``ray start --address``. Each dir in *private* is an empty tmpfs for this node only (its own
        mount namespace, which its raylet and workers keep): a node that shares no disk with the others
        there. *make*: dirs to create inside those before Ray starts. *ip*: Ray takes 127.0.0.1 for
        this machine's address, the head's too, and a driver attaches to any raylet at its own
        address; another loopback address (127.0.0.2) keeps drivers off this node."""
        prefix: tuple[str, ...] = ()
        if private:
            steps = [f"mount -t tmpfs tmpfs {shlex.quote(str(p))}" for p in private]
            steps += [f"mkdir -p {shlex.quote(str(p))}" for p in make] + ['exec "$0" "$@"']
            prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(steps))
        self.ray("start", f"--address={self.address}", f"--node-ip-address={ip}", *self._worker_ports(), *extra,
                 env=env, prefix=prefix)
        return self

    def stop(self) -> list[int]:
        pids = stop_marked(self.token)
        if not os.environ.get("RRS_TEST_KEEP_CLUSTER"):  # set it to read a failed run's Ray logs
            shutil.rmtree(self.root, ignore_errors=True)
        return pids

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
