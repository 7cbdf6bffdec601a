"""A real ``moto_server`` subprocess as a fake S3 endpoint on loopback.

A subprocess (not ``ThreadedMotoServer``) is used so that every client -- boto3,
pyarrow, the Run:ai C++ streamer, Ray workers, vLLM's EngineCore -- talks to it
over real HTTP, and so that the werkzeug access log gives a server-side record
of every request (method, path, status: 200 for a full GET, 206 for a ranged
one) that tests can assert on.

moto keeps all buckets in memory: ``restart()`` brings the server back on the
same port but EMPTY; re-upload whatever the test needs afterwards.

IAM: ``iam_user()`` creates users with a policy, ``enforce_auth()`` then makes
the server check every request's credentials and permissions (moto's IAM auth),
for tests of missing, wrong and list-only credentials. Use a server of its own
for that: once enforced, the dummy ``testing`` credentials are refused.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, NamedTuple
from urllib.parse import unquote, urlsplit

from .servers import free_port, stop_process  # noqa: F401  (free_port: re-exported for the tests)

__all__ = ["Request", "S3Server", "free_port", "start_s3_server"]

# werkzeug: 127.0.0.1 - - [02/Dec/2025 17:00:00] "GET /b/k?x=1 HTTP/1.1" 206 -
_LOG_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) ')
# werkzeug colours some lines (e.g. 206 responses) with ANSI escapes even when
# writing to a file, so they are stripped before matching.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Readiness probes and moto's own control API are not S3 traffic.
_INTERNAL_PREFIX = "/moto-api"


class Request(NamedTuple):
    """One request seen by the server; ``path`` is unquoted, ``query`` the raw query string."""

    method: str
    path: str
    status: int
    query: str = ""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux), so a test
    process killed without cleanup (SIGKILL, SIGPIPE) leaves no moto_server behind.
    Note this follows the parent THREAD that started the server."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _moto_command(port: int) -> list[str]:
    """Prefer the ``moto_server`` script next to the caller's interpreter."""
    script = Path(sys.executable).parent / "moto_server"
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


class S3Server:
    """A ``moto_server`` on 127.0.0.1 whose stdout/stderr are appended to ``log_path``."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.log_path = Path(log_path)
        self.port = port if port is not None else free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self, timeout: float = 20.0) -> S3Server:
        """Start the server and wait until it answers HTTP."""
        if self.running:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # access-log lines must reach the file promptly
        env.pop("MOTO_PORT", None)
        self._proc = subprocess.Popen(
            _moto_command(self.port),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}{_INTERNAL_PREFIX}/", timeout=1):
                    pass
                break
            except urllib.error.HTTPError:
                break  # any HTTP answer means it is serving
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"moto_server did not answer on {self.endpoint} within {timeout}s"
                    ) from None
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s)."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        stop_process(proc)
        self._close_log()

    def restart(self) -> S3Server:
        """Stop and start again on the same port. moto is in-memory: all data is LOST."""
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        """Whether the subprocess is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation -------------------------------------------------------
    def requests(self, since: int = 0) -> list[Request]:
        """Parse the werkzeug access log into requests (S3 traffic only, in order).

        ``since`` drops the first N parsed requests, so a test can take
        ``n = len(srv.requests())`` as a mark and later look at ``srv.requests(n)``.
        """
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        out: list[Request] = []
        for line in text.splitlines():
            m = _LOG_LINE.search(_ANSI.sub("", line))
            if m is None:
                continue
            path = unquote(urlsplit(m["target"]).path)
            if path.startswith(_INTERNAL_PREFIX):
                continue
            out.append(Request(m["method"], path, int(m["status"]), urlsplit(m["target"]).query))
        return out[since:]

    # -- clients -----------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment variables that point boto3, pyarrow (via the test adapter) and
        the Run:ai streamer at this server with moto's dummy credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        }

    def client(self) -> Any:
        """A boto3 S3 client bound to this server (path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )

    def iam_user(self, name: str, actions: list[str], resource: str = "*") -> tuple[str, str]:
        """Create IAM user *name* allowed *actions* on *resource*; returns (key id, secret).
        Call before :meth:`enforce_auth`."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": resource}]}
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def enforce_auth(self, after: int = 0) -> None:
        """Check IAM credentials on every request after the next *after* ones."""
        req = urllib.request.Request(
            f"{self.endpoint}{_INTERNAL_PREFIX}/reset-auth",
            data=str(after).encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=5):
            pass

    def reset(self) -> None:
        """Drop all buckets/objects (moto's control API) without restarting."""
        req = urllib.request.Request(f"{self.endpoint}{_INTERNAL_PREFIX}/reset", method="POST")
        with urllib.request.urlopen(req, timeout=5):
            pass


def start_s3_server(log_dir: Path) -> S3Server:
    """Start a fresh server logging to ``log_dir/moto.<port>.log``."""
    port = free_port()
    return S3Server(Path(log_dir) / f"moto.{port}.log", port=port).start()
