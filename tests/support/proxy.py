"""A TCP proxy on 127.0.0.1 in front of a local store: one shared link, limited and counted.

Loopback is far faster than any real store link, so a test or benchmark whose result
depends on bandwidth puts this between its readers and the S3 server: every byte the
store sends passes one token bucket (``rate`` bytes/s for all connections together, as
on a node's one link) and is counted. ``rate=None`` counts without limiting.
Used by the relay tests and ``bench/bench_nodes.py``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional


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
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._count_lock:
            self.downstream = self.upstream_bytes = self.connections = 0

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
            for src, dst, down in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, down), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
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
