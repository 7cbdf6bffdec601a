"""A server process on 127.0.0.1, started by us and stopped by its PID.

Shared by the test fixtures and ``bench/`` (which puts ``tests/`` on sys.path the
way ``conftest.py`` does). A subclass names the command and where to probe for
readiness; this class owns the lifecycle: pick a free port, start with output
appended to a log file, wait for any HTTP answer, and on stop SIGTERM, then
SIGKILL after 5 s. Only the one PID it started is ever signalled.
"""

from __future__ import annotations

import atexit
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional


def free_port() -> int:
    """Return a currently free TCP port on 127.0.0.1 (racy, but fine on a test box)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int, avoid: frozenset = frozenset()) -> list[int]:
    """*count* distinct free ports, none in *avoid*: the sockets stay bound until all are chosen
    (one ``free_port()`` after another can hand out the same port twice: a CI run's
    ``ray start`` got its GCS port again as its client-server port)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] in avoid:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_process(proc: Optional[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after 5 s; a no-op if it is not running."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["ServerProcess", "free_port", "stop_process"]


class ServerProcess:
    """One server subprocess on 127.0.0.1 whose stdout/stderr are appended to ``log_path``.

    Subclasses implement :meth:`command`; they may override :attr:`name` (for
    messages), :attr:`ready_path` (the URL path probed until it answers),
    :attr:`poll_interval` and :meth:`popen_kwargs` (e.g. ``env``, ``preexec_fn``).
    """

    name = "server"
    ready_path = "/"
    poll_interval = 0.1

    def __init__(self, log_path: Path, port: Optional[int] = None) -> None:
        self.log_path = Path(log_path)
        self.port = port if port is not None else free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    # -- what to run -------------------------------------------------------
    def command(self) -> list[str]:
        """The argv that starts the server on ``self.port``."""
        raise NotImplementedError

    def popen_kwargs(self) -> dict[str, Any]:
        """Extra ``subprocess.Popen`` arguments."""
        return {}

    # -- lifecycle ---------------------------------------------------------
    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start and wait until it answers HTTP (any status); a no-op if running.

        Raises RuntimeError if it exits first, TimeoutError (after stopping it)
        if it does not answer within ``timeout`` seconds.
        """
        if self.running:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **self.popen_kwargs(),
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.endpoint + self.ready_path, timeout=1):
                    return self
            except urllib.error.HTTPError:
                return self  # any HTTP answer means it is serving
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{self.name} did not answer on {self.endpoint}") from None
                time.sleep(self.poll_interval)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; a no-op if not running."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        stop_process(proc)

    @property
    def running(self) -> bool:
        """Whether the subprocess is alive."""
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
