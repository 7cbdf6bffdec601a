"""Session fixtures: a real S3 server on loopback, the tiny models in it, isolated homes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import shm
from .diskscan import find_weight_bytes
from .procs import base_env
from .s3server import S3Server, start_s3_server
from .tiny_model import build_tiny_model, nonweight_files, upload_dir, weight_files

BUCKET = "models"
CACHE = Path(os.environ.get("RAY_RUNAI_SHIM_TEST_CACHE", Path(tempfile.gettempdir()) / "ray-runai-shim-test-cache"))


@dataclass
class TinyModel:
    name: str
    local: Path
    uri: str
    weights: list[str]
    nonweights: list[str]

    def weight_paths(self) -> dict[str, Path]:
        return {w: self.local / w for w in self.weights}


_SHM_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session):
    """The run's own view of /dev/shm, taken once by the process that runs the workers."""
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_SHM_BEFORE] = shm.snapshot()


def pytest_sessionfinish(session, exitstatus):
    """After every worker: the vLLM segments the run's engines left that a module's own sweep
    skipped because a stopping engine's process still held them then (one CI run left two)."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is not None:
        try:
            shm.clean_new(before, wait_s=30)
        except Exception as e:  # hygiene must never fail the run
            print(f"/dev/shm sweep failed: {e}", file=sys.stderr)


@pytest.fixture(scope="module", autouse=True)
def _leave_dev_shm_as_found():
    """The vLLM segments this module's engines left in /dev/shm go when it ends (support/shm.py)."""
    before = shm.snapshot()
    yield
    shm.clean_new(before)


@pytest.fixture(scope="module")
def serve_exclusive():
    """One test file that starts Ray Serve at a time, across ``./dev test``'s workers: a Serve
    proxy started beside another one on a 2-core box missed its readiness check and died."""
    import fcntl

    with open(Path(tempfile.gettempdir()) / "ray-runai-shim-tests-serve.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> S3Server:
    server = start_s3_server(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


def upload_models(server: S3Server) -> dict[str, TinyModel]:
    client = server.client()
    out = {}
    for name, shards in (("tiny", 1), ("tiny-sharded", 2)):
        local = build_tiny_model(CACHE / f"{name}-v1", shards=shards)
        upload_dir(client, local, BUCKET, f"llm/{name}")
        out[name] = TinyModel(
            name, local, f"s3://{BUCKET}/llm/{name}", weight_files(local), nonweight_files(local)
        )
    return out


#: Checkpoints whose tokenizer files Ray's tokenizer-only download cannot serve (ray#62047):
#: the chat template only in chat_template.jinja; GPT-2 style vocab.json + merges.txt.
LAYOUT_MODELS = {"jinja": "tiny-jinja", "bpe-files": "tiny-bpe"}


@pytest.fixture(scope="session")
def layout_models(s3) -> dict[str, TinyModel]:
    client = s3.client()
    out = {}
    for layout, name in LAYOUT_MODELS.items():
        local = build_tiny_model(CACHE / f"{name}-v1", shards=2, layout=layout)
        upload_dir(client, local, BUCKET, f"llm/{name}")
        out[layout] = TinyModel(name, local, f"s3://{BUCKET}/llm/{name}", weight_files(local), nonweight_files(local))
    return out


PUBLIC_BUCKET = "public-models"  # anyone may list and read it (policy + object ACLs), as moto checks unsigned requests


def public_copy(s3: S3Server, model: TinyModel) -> str:
    """*model* in a public bucket (made once per server); its plain ``s3://`` URI there."""
    client = s3.client()
    if PUBLIC_BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=PUBLIC_BUCKET)
        client.put_bucket_policy(Bucket=PUBLIC_BUCKET, Policy=json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{PUBLIC_BUCKET}", f"arn:aws:s3:::{PUBLIC_BUCKET}/*"]}]}))
    prefix = f"llm/{model.name}"
    if not client.list_objects_v2(Bucket=PUBLIC_BUCKET, Prefix=f"{prefix}/").get("Contents"):
        upload_dir(client, model.local, PUBLIC_BUCKET, prefix)
        for obj in client.list_objects_v2(Bucket=PUBLIC_BUCKET, Prefix=f"{prefix}/")["Contents"]:
            client.put_object_acl(Bucket=PUBLIC_BUCKET, Key=obj["Key"], ACL="public-read")
    return model.uri.replace(f"s3://{BUCKET}/", f"s3://{PUBLIC_BUCKET}/", 1)


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The sdist and wheel, built from this checkout the way a release would be."""
    import subprocess
    import sys

    from .procs import REPO

    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], check=True,
                   capture_output=True, timeout=600)
    return dist


@pytest.fixture(scope="session")
def models(s3) -> dict[str, TinyModel]:
    return upload_models(s3)


@dataclass
class Sandbox:
    """One isolated machine-user: its own HOME, HF cache, temp dir and vLLM cache."""

    root: Path
    env: dict[str, str]
    engine_log: Path
    scan_roots: list[Path] = field(default_factory=list)

    def engine_calls(self) -> list[dict[str, Any]]:
        if not self.engine_log.exists():
            return []
        return [json.loads(line) for line in self.engine_log.read_text().splitlines() if line.strip()]

    def weight_bytes_on_disk(self, model: TinyModel) -> list[Path]:
        return find_weight_bytes(self.scan_roots, model.weight_paths())

    def shim_dirs(self) -> list[Path]:
        root = self.root / "hf" / "hub" / "ray-runai-shim"
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []


def make_sandbox(s3: S3Server, root: Path, **extra: str) -> Sandbox:
    for d in ("home", "hf", "tmp", "cache"):
        (root / d).mkdir(parents=True, exist_ok=True)
    engine_log = root / "engine-calls.jsonl"
    env = base_env(
        {
            **s3.env(),
            "HOME": str(root / "home"),
            "HF_HOME": str(root / "hf"),
            "XDG_CACHE_HOME": str(root / "cache"),
            "TMPDIR": str(root / "tmp"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vLLM's model-class inspection (a ~10 s subprocess per engine) is cached here, keyed by
            # vLLM's source hash: shared across sandboxes, it runs once per test run. Assets (which
            # the shim's aux pull writes) stay under the sandbox's XDG_CACHE_HOME.
            "VLLM_CACHE_ROOT": str(CACHE / "vllm-cache"),
            # The same for torch's compiled kernels: with TP > 1 every rank compiles vLLM's masked
            # vocab lookup (~10 CPU-s of C++ per rank) into TMPDIR/torchinductor_<user> unless told.
            "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "torchinductor"),
            "VLLM_HOST_IP": "127.0.0.1",
            "RAY_RUNAI_SHIM_TEST_COMPAT": "1",
            "RAY_RUNAI_SHIM_TEST_ENGINE_LOG": str(engine_log),
            "TOKENIZERS_PARALLELISM": "false",
            **extra,
        }
    )
    return Sandbox(root, env, engine_log, [root])


@pytest.fixture
def shared_tmp():
    """A directory other uids can reach (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="rrs-shared-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_relay_dir():
    """A node relay directory of the test's own in /dev/shm (``RAY_RUNAI_SHIM_RELAY_DIR``)."""
    with shm.tmpdir("rrs-relay-") as d:
        yield d


@pytest.fixture
def sandbox(s3, tmp_path_factory) -> Sandbox:
    # Short, private path: Ray's socket paths must stay under ~107 characters.
    root = Path(tempfile.mkdtemp(prefix="rrs-", dir="/tmp"))
    yield make_sandbox(s3, root)
    shutil.rmtree(root, ignore_errors=True)
