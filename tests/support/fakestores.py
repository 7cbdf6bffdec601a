"""Tiny HTTP stand-ins for store behaviour moto cannot produce, spoken to by real pyarrow.

* :class:`FakeGcs`: the slice of the Google Cloud Storage JSON API that pyarrow's
  ``GcsFileSystem`` uses (list, object metadata, media download), with object
  generations, or a fixed error (403/401/404) for every request. There is no GCS
  emulator here; this gives the real pyarrow/google-cloud-cpp client and its real
  error texts.
* :class:`FakeS3`: answers every S3 request with a chosen status and S3 error code
  (a bucket in another region, an expired token), or HEAD fine and GET refused; with
  ``body`` it answers that raw body instead (a proxy's HTML page, or nothing at all).
  Used as ``AWS_ENDPOINT_URL``, it is the fault server for HTTP status classes (429,
  500, 502, 503, 504, 408).

Both run on 127.0.0.1 in a thread; ``close()`` stops them.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit


class _Server:
    def __init__(self, handler: type) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self.requests: list[tuple[str, str]] = []
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str, headers: Optional[dict[str, str]] = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class FakeGcs(_Server):
    """``objects``: name -> bytes in bucket ``bucket``; ``error``: (status, reason, message)
    returned for every request instead; ``page``: (status, raw body) for every request, as a
    proxy in front of the store would answer."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.error: Optional[tuple[int, str, str]] = None
        self.page: Optional[tuple[int, bytes]] = None
        self._generation = 1700000000000000
        super().__init__(_GcsHandler)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def put(self, name: str, data: bytes) -> None:
        self._generation += 1
        self.objects[name] = (data, self._generation)

    def filesystem(self):
        import datetime

        import pyarrow.fs as pa_fs

        return pa_fs.GcsFileSystem(
            anonymous=True, endpoint_override=self.endpoint, scheme="http",
            retry_time_limit=datetime.timedelta(seconds=1),
        )

    def resource(self, name: str) -> dict:
        data, generation = self.objects[name]
        return {
            "kind": "storage#object", "name": name, "bucket": self.bucket, "size": str(len(data)),
            "generation": str(generation), "metageneration": "1",
            "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
            "etag": base64.b64encode(str(generation).encode()).decode(),
            "updated": "2025-01-01T00:00:00.000Z", "timeCreated": "2025-01-01T00:00:00.000Z",
        }


class _GcsHandler(_Handler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        srv: FakeGcs = self.server.owner  # type: ignore[attr-defined]
        srv.requests.append((self.command, self.path))
        if srv.page is not None:
            return self._send(srv.page[0], srv.page[1], "text/html")
        if srv.error is not None:
            code, reason, message = srv.error
            body = {"error": {"code": code, "message": message,
                              "errors": [{"message": message, "domain": "global", "reason": reason}]}}
            return self._send(code, json.dumps(body).encode(), "application/json")
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path.endswith("/o"):
            prefix = query.get("prefix", [""])[0]
            items = [srv.resource(n) for n in sorted(srv.objects) if n.startswith(prefix)]
            return self._send(200, json.dumps({"kind": "storage#objects", "items": items}).encode(), "application/json")
        name = unquote(url.path.split("/o/", 1)[1])
        if name not in srv.objects:
            body = {"error": {"code": 404, "message": "No such object", "errors": [{"reason": "notFound"}]}}
            return self._send(404, json.dumps(body).encode(), "application/json")
        if query.get("alt") == ["media"]:
            data, generation = srv.objects[name]
            return self._send(200, data, "application/octet-stream", {"x-goog-generation": str(generation)})
        return self._send(200, json.dumps(srv.resource(name)).encode(), "application/json")


class FakeS3(_Server):
    """Every request gets ``status`` with S3 error ``code``. With ``keys`` (key -> size)
    listing and HEAD succeed and only object GETs fail: an identity that may list and
    HEAD but not read the bytes (a bucket policy, SSE-KMS without kms:Decrypt). With
    ``body`` the failing requests get that raw body (``content_type``) instead of S3's XML."""

    def __init__(self, status: int, code: str = "", message: str = "", keys: Optional[dict[str, int]] = None,
                 body: Optional[bytes] = None, content_type: str = "text/html") -> None:
        self.status, self.code, self.message, self.keys = status, code, message, keys
        self.body, self.content_type = body, content_type
        super().__init__(_S3Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _S3Handler(_Handler):
    def _answer(self) -> None:
        srv: FakeS3 = self.server.owner  # type: ignore[attr-defined]
        srv.requests.append((self.command, self.path))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        url = urlsplit(self.path)
        key = unquote(url.path).split("/", 2)[-1]
        if srv.keys is not None and self.command == "GET" and "list-type=2" in url.query:
            prefix = parse_qs(url.query).get("prefix", [""])[0]
            contents = "".join(
                f"<Contents><Key>{k}</Key><LastModified>2025-01-01T00:00:00.000Z</LastModified>"
                f'<ETag>"e{i}"</ETag><Size>{n}</Size><StorageClass>STANDARD</StorageClass></Contents>'
                for i, (k, n) in enumerate(sorted(srv.keys.items())) if k.startswith(prefix)
            )
            body = (
                '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>b</Name><Prefix>{prefix}</Prefix><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
                f"{contents}</ListBucketResult>"
            ).encode()
            return self._send(200, body, "application/xml")
        if srv.keys is not None and self.command == "HEAD" and key in srv.keys:
            self.send_response(200)
            self.send_header("Content-Length", str(srv.keys[key]))
            self.send_header("ETag", '"abc"')
            self.end_headers()
            return None
        if srv.body is not None:
            return self._send(srv.status, srv.body, srv.content_type)
        body = (
            f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{srv.code}</Code>"
            f"<Message>{srv.message}</Message><RequestId>0</RequestId></Error>"
        ).encode()
        return self._send(srv.status, body, "application/xml")

    do_GET = do_HEAD = do_PUT = do_POST = _answer
