"""bench part: the s3rver that serves the synthetic models, and a client for it.

s3rver (Node) rather than moto: moto copies the whole object on every GET, so it
does not scale to GiB objects. The process lifecycle (free port, log file, wait
for HTTP, SIGTERM/SIGKILL by PID) is the tests' ``support.servers.ServerProcess``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # as conftest.py does: tests/support -> support

from support.servers import ServerProcess, free_port  # noqa: E402

__all__ = ["BUCKET", "S3RVER_PREFIX", "S3RVER_VERSION", "S3rver", "ensure_s3rver", "free_port", "s3_client"]

S3RVER_VERSION = "3.7.1"
S3RVER_PREFIX = BENCH_DIR / ".s3rver"
BUCKET = "bench"


def ensure_s3rver() -> Path:
    """Install s3rver into bench/.s3rver once; return its CLI script."""
    cli = S3RVER_PREFIX / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    if cli.is_file():
        return cli
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH; s3rver (a Node package) is needed for this benchmark")
    print(f"installing s3rver@{S3RVER_VERSION} into {S3RVER_PREFIX} ...", flush=True)
    S3RVER_PREFIX.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            npm,
            "install",
            "--prefix",
            str(S3RVER_PREFIX),
            "--no-audit",
            "--no-fund",
            f"s3rver@{S3RVER_VERSION}",
        ],
        check=True,
    )
    if not cli.is_file():
        raise RuntimeError(f"npm install finished but {cli} is missing")
    return cli


class S3rver(ServerProcess):
    """An s3rver subprocess on 127.0.0.1 with an on-disk data dir (big objects stay off the heap)."""

    name = "s3rver"

    def __init__(self, cli: Path, data_dir: Path, log_path: Path) -> None:
        super().__init__(log_path)
        self.cli = cli
        self.data_dir = data_dir

    def command(self) -> list[str]:
        node = shutil.which("node") or "node"
        return [
            node,
            str(self.cli),
            "-d",
            str(self.data_dir),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "--no-vhost-buckets",
            "--allow-mismatched-signatures",
            "-s",
        ]

    def start(self, timeout: float = 30.0) -> S3rver:
        """Start and wait until it answers HTTP."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        super().start(timeout)
        return self

    def env(self) -> dict[str, str]:
        """What boto3, pyarrow (through the shim's endpoint patch) and the streamer read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "S3RVER",
            "AWS_SECRET_ACCESS_KEY": "S3RVER",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_S3_ADDRESSING_STYLE": "path",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }


def s3_client(endpoint: str) -> Any:
    """A path-style boto3 client for s3rver."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="S3RVER",
        aws_secret_access_key="S3RVER",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
    )
