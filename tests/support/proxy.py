"""A TCP proxy on 127.0.0.1 in front of a local store: one shared link, limited and counted.

Loopback is far faster than any real store link, so a test or benchmark whose result
depends on bandwidth puts this between its readers and the S3 server: every byte the
store sends passes one token bucket (``rate`` bytes/s for all connections together, as
on a node's one link) and is counted. ``rate=None`` counts without limiting.
HTTP/1.1 responses are followed per connection, so the bytes of each object's bodies are
counted apart (``by_path``): "weight bytes from the store" excludes listings and headers.
Used by the relay tests and ``bench/bench_nodes.py``.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Optional
from urllib.parse import unquote, urlsplit


class _Bucket:
    def __init__(self, rate: Optional[float]) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
            wait = self.next_free - now
        if wait > 0:
            time.sleep(wait)


_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r\n")


class _HttpTap:
    """Attribute response body bytes to the request path they answer (keep-alive, in order)."""

    def __init__(self, count: Callable[[str, int], None]) -> None:
        self.pending: deque = deque()
        self.head = b""
        self.body_left = 0
        self.path = "?"
        self.count = count
        self.lost = False  # a reply this tap cannot follow (chunked): count the rest as "?"

    def request(self, data: bytes) -> None:
        for m in _REQUEST.finditer(data):
            self.pending.append((m.group(1).decode(), unquote(urlsplit(m.group(2).decode()).path)))

    def response(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.lost:
                self.count("?", len(view))
                return
            if self.body_left:
                n = min(self.body_left, len(view))
                self.count(self.path, n)
                self.body_left -= n
                view = view[n:]
                continue
            self.head += bytes(view)
            view = memoryview(b"")
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, rest = self.head[:end], self.head[end + 4:]
            self.head = b""
            method, self.path = self.pending.popleft() if self.pending else ("GET", "?")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
            if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                self.body_left = 0
            elif length is None:
                self.lost = True
            else:
                self.body_left = int(length.group(1))
            view = memoryview(rest)


class CountingProxy:
    """``CountingProxy(upstream_port, rate).start()``; ``.endpoint`` is the URL to use as
    ``AWS_ENDPOINT_URL``; ``.downstream`` counts bytes the store sent to readers."""

    def __init__(self, upstream_port: int, rate: Optional[float] = None, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.bucket = _Bucket(rate)
        self._count_lock = threading.Lock()
        self.downstream = 0
        self.upstream_bytes = 0
        self.connections = 0
        self.by_path: dict[str, int] = defaultdict(int)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._stalls: list[tuple[str, float]] = []  # (path suffix, seconds): one pause each

    def stall(self, suffix: str, seconds: float, times: int = 1) -> None:
        """Pause the next *times* response bodies of paths ending in *suffix* for *seconds*
        (a store link that stops sending mid-object, as a congested or starved one does)."""
        with self._count_lock:
            self._stalls.extend([(suffix, seconds)] * times)

    def set_rate(self, rate: Optional[float]) -> None:
        """Change the link's rate from now on (``None``: unlimited). A test that needs a copy
        still incomplete while something else happens starts slow and speeds up once it has
        seen it, instead of betting on how fast this machine is."""
        with self.bucket.lock:
            self.bucket.rate = rate
            self.bucket.next_free = min(self.bucket.next_free, time.monotonic())

    def _take_stall(self, path: str) -> float:
        with self._count_lock:
            for i, (suffix, seconds) in enumerate(self._stalls):
                if path.endswith(suffix):
                    del self._stalls[i]
                    return seconds
        return 0.0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._count_lock:
            self.downstream = self.upstream_bytes = self.connections = 0
            self.by_path.clear()

    def body_bytes(self, suffix: str) -> int:
        """Response body bytes of every object whose path ends with *suffix*."""
        with self._count_lock:
            return sum(n for path, n in self.by_path.items() if path.endswith(suffix))

    def _count_path(self, path: str, n: int) -> None:
        with self._count_lock:
            self.by_path[path] += n

    def start(self) -> CountingProxy:
        t = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._sock.close()
        except OSError:
            pass
        for s in list(self._open):
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._count_lock:
                self.connections += 1
            self._open.update((client, server))
            tap = _HttpTap(self._count_path)
            for src, dst, down in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, down, tap), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool, tap: _HttpTap) -> None:
        try:
            while True:
                data = src.recv(64 << 10)
                if not data:
                    break
                if down:
                    self.bucket.take(len(data))
                with self._count_lock:
                    if down:
                        self.downstream += len(data)
                    else:
                        self.upstream_bytes += len(data)
                if down:
                    tap.response(data)
                    if tap.body_left and self._stalls:
                        pause = self._take_stall(tap.path)
                        if pause:
                            time.sleep(pause)
                else:
                    tap.request(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass
                self._open.discard(s)
