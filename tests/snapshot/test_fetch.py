"""The narrowed fetch against real S3 servers: concurrency, faults, staleness, shared nodes.

Every test runs the real fetch code against a real ``moto_server`` over HTTP on
loopback; where the issue needs a process of its own (kill -9, another uid, a
file-size limit, a reader holding a snapshot) it runs ``support/fetchchild.py``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import pytest
from support.diskscan import find_weight_bytes
from support.fetchchild import child_env, run_child, start_child
from support.fixtures import BUCKET
from support.s3server import start_s3_server

from ray_runai_shim.errors import ShimError
from ray_runai_shim.snapshot import cache
from ray_runai_shim.snapshot.fetch import MANIFEST, fetch_nonweights, list_model
from ray_runai_shim.snapshot.staging import owner_token
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

NOBODY = 65534


def fs_for(endpoint: str):
    def fs_and_path(uri: str):
        return endpoint_s3_filesystem(False, endpoint), uri.split("://", 1)[1]

    return fs_and_path


@pytest.fixture
def s3env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def upload(client, model, prefix: str, bucket: str = BUCKET, **override: bytes) -> str:
    """Upload *model* under *prefix*, replacing the files named in *override*; returns the URI."""
    for rel in model.nonweights + model.weights:
        if rel in override:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=override[rel])
        else:
            client.upload_file(str(model.local / rel), bucket, f"{prefix}/{rel}")
    for rel, body in override.items():
        if rel not in model.nonweights + model.weights:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=body)
    return f"s3://{bucket}/{prefix}"


def snapshot_dirs(root: Path) -> list[Path]:
    base = root / cache.DIR_NAME
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.exists() else []


def files_of(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST}




# --------------------------------------------------------------------------- concurrency


def _worker(args):
    endpoint, uri, root = args
    for k, v in json.loads(os.environ["RRS_S3_ENV"]).items():
        os.environ[k] = v
    r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=Path(root))
    return r.local_dir, r.fetched_files, r.reused


def test_four_processes_on_one_node_fetch_each_file_exactly_once(s3env, models, tmp_path):
    model = models["tiny-sharded"]
    mark = len(s3env.requests())
    os.environ["RRS_S3_ENV"] = json.dumps(s3env.env())
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_worker, [(s3env.endpoint, model.uri, str(tmp_path))] * 4)
    dirs = {r[0] for r in results}
    assert len(dirs) == 1
    assert sorted(r[1] for r in results) == [0, 0, 0, len(model.nonweights)]
    gets = [r.path for r in s3env.requests(mark) if r.method == "GET" and "/llm/tiny-sharded/" in r.path]
    per_key = {p: gets.count(p) for p in gets}
    assert per_key == {f"/{BUCKET}/llm/tiny-sharded/{k}": 1 for k in model.nonweights}
    final = Path(dirs.pop())
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()) == sorted(
        model.nonweights + [MANIFEST]
    )
    assert json.loads((final / MANIFEST).read_text())["source"] == model.uri
    assert cache.snapshot_source(str(final)) == model.uri  # how Serve recognises the dir
    assert find_weight_bytes([tmp_path], model.weight_paths()) == []


# --------------------------------------------------------------------------- faults


class DroppingProxy:
    """A loopback TCP proxy to the S3 server that cuts responses after *budget* bytes."""

    def __init__(self, target_port: int, budget: int) -> None:
        self.target_port, self.budget = target_port, budget
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.dropping = True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def up() -> None:
            try:
                while data := client.recv(65536):
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := upstream.recv(65536):
                if self.dropping and sent + len(data) > self.budget:
                    client.sendall(data[: max(0, self.budget - sent)])
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_connection_dropped_mid_fetch_leaves_nothing_and_a_rerun_succeeds(s3env, models, tmp_path, monkeypatch):
    model = models["tiny"]
    big = os.urandom(3 << 20)  # a non-weight object big enough that the cut lands inside its body
    uri = upload(s3env.client(), model, "llm/faulty", **{"tokenizer.json": big})
    proxy = DroppingProxy(s3env.port, budget=1 << 20)
    endpoint = f"http://127.0.0.1:{proxy.port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    try:
        with pytest.raises(ShimError) as err:
            fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
        msg = str(err.value)
        assert f"{uri}/tokenizer.json" in msg and endpoint in msg
        assert "broke off mid-transfer" in msg and "curlCode: 18" in msg  # the cause, and the store's words
        assert "cannot write" not in msg  # a store fault, not blamed on the local disk
        assert snapshot_dirs(tmp_path) == []  # no snapshot a later run could take for complete
        leftovers = [p.name for p in (tmp_path / cache.DIR_NAME).iterdir() if not p.name.endswith("lock")]
        assert leftovers == []  # no staging dir, no partial file under any name
        proxy.dropping = False
        r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
        assert (Path(r.local_dir) / "tokenizer.json").read_bytes() == big
        assert not r.reused and r.fetched_files == len(model.nonweights)
    finally:
        proxy.close()


def test_kill_9_mid_fetch_leaves_no_snapshot_and_the_next_run_removes_its_staging(s3env, models, shared_tmp):
    model = models["tiny"]
    big = os.urandom(3 << 20)
    uri = upload(s3env.client(), model, "llm/killed", **{"tokenizer.json": big})
    root = shared_tmp / "cache"
    base = root / cache.DIR_NAME
    proc = start_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(root), "chunk": 64 << 10,
                        "slow": 0.05}, child_env(s3env, shared_tmp))
    try:
        deadline = time.monotonic() + 60
        partial: list[Path] = []
        while not partial:
            assert proc.poll() is None and time.monotonic() < deadline, "the child finished before it was killed"
            partial = [p for p in base.glob(".staging-*/tokenizer.json") if p.stat().st_size > 0] if base.exists() else []
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    [staging] = [p for p in base.iterdir() if p.name.startswith(".staging-")]
    assert 0 < (staging / "tokenizer.json").stat().st_size < len(big)  # it died mid-object
    assert snapshot_dirs(root) == []  # nothing that looks complete
    assert not cache.staging_owner_alive(staging.name)
    # Control: a staging dir of a live process (this one) is left alone by the same cleanup.
    live = base / f".staging-{owner_token()}-0123abcd"
    live.mkdir()

    r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=root)
    assert (Path(r.local_dir) / "tokenizer.json").read_bytes() == big
    assert not staging.exists() and live.exists()
    assert [p.name for p in base.iterdir() if p.name.startswith(".staging-")] == [live.name]
    live.rmdir()


def test_rlimit_fsize_as_a_full_disk_names_the_local_cause_not_the_store(s3env, models, shared_tmp):
    model = models["tiny"]
    uri = upload(s3env.client(), model, "llm/fsize", **{"tokenizer.json": os.urandom(3 << 20)})
    root = shared_tmp / "cache"
    out, _ = run_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(root)}, child_env(s3env, shared_tmp),
                       fsize=1 << 20)
    msg = out.get("error", "")
    assert out.get("type") == "ShimError", out
    assert "EFBIG" in msg and "File too large" in msg and "RLIMIT_FSIZE" in msg
    assert str(root / cache.DIR_NAME) in msg and "RAY_RUNAI_SHIM_CACHE_DIR" in msg  # the path and the fix
    assert "reachable" not in msg and "store said" not in msg  # not blamed on the store
    assert snapshot_dirs(root) == [] and not list((root / cache.DIR_NAME).glob(".staging-*"))
    # Control: the same child without the limit succeeds, so the limit is what failed it.
    ok, _ = run_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(root)}, child_env(s3env, shared_tmp))
    assert "local_dir" in ok, ok
    assert find_weight_bytes([shared_tmp], model.weight_paths()) == []


def _in_tmpfs(mnt: Path, options: str) -> tuple[str, ...]:
    """Run the child in a mount namespace of its own with a tmpfs on *mnt* (skip if impossible)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o {options} tmpfs "$0" && exec "$@"', str(mnt))


def test_a_really_full_disk_names_the_disk_and_the_space_needed(s3env, models, shared_tmp):
    model = models["tiny"]
    uri = upload(s3env.client(), model, "llm/full", **{"tokenizer.json": os.urandom(3 << 20)})
    mnt = shared_tmp / "small-disk"
    mnt.mkdir()
    out, _ = run_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(mnt)}, child_env(s3env, shared_tmp),
                       wrap=_in_tmpfs(mnt, "size=1m"))
    msg = out.get("error", "")
    assert out.get("type") == "ShimError", out
    assert "ENOSPC" in msg and f"the disk holding {mnt}/ray-runai-shim/.staging-" in msg and "is full" in msg
    assert "non-weight files need 3.0 MiB" in msg and "RAY_RUNAI_SHIM_CACHE_DIR" in msg
    assert "reachable" not in msg and "store said" not in msg


def test_a_read_only_filesystem_as_cache_fetches_into_a_private_dir(s3env, models, shared_tmp):
    model = models["tiny"]
    mnt = shared_tmp / "ro-disk"
    mnt.mkdir()
    tmpdir = shared_tmp / "tmp"
    tmpdir.mkdir()
    out, err = run_child({"uri": model.uri, "endpoint": s3env.endpoint, "root": str(mnt), "probe_write": str(mnt)},
                         child_env(s3env, shared_tmp, TMPDIR=str(tmpdir)), wrap=_in_tmpfs(mnt, "ro"))
    assert out["old_mkdir"] == "OSError"  # control: EROFS even for root, where the old code gave up
    assert out.get("private") and Path(out["local_dir"]).parent == tmpdir / f"ray-runai-shim-{os.getuid()}" / cache.DIR_NAME
    assert files_of(Path(out["local_dir"])) == {rel: (model.local / rel).read_bytes() for rel in model.nonweights}
    assert "EROFS" in err and "RAY_RUNAI_SHIM_CACHE_DIR" in err and "failed unexpectedly" not in err
    assert find_weight_bytes([shared_tmp], model.weight_paths()) == []


def test_a_key_too_long_for_the_local_filesystem_is_a_local_error(s3env, models, tmp_path):
    model = models["tiny"]
    long_name = "n" * 300 + ".json"  # a valid S3 key, too long for one ext4/xfs name
    uri = upload(s3env.client(), model, "llm/longname", **{long_name: b"{}"})
    with pytest.raises(ShimError) as err:
        fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    msg = str(err.value)
    assert "ENAMETOOLONG" in msg and "shorten" in msg and "RAY_RUNAI_SHIM_CACHE_DIR" in msg
    assert "reachable" not in msg and "store said" not in msg
    assert snapshot_dirs(tmp_path) == []


# --------------------------------------------------------------------------- bytes as stored


def _pyarrow_compressed(data: bytes, codec: str) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, codec) as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def test_objects_named_like_compressed_files_reach_the_snapshot_byte_for_byte(s3env, models, tmp_path):
    """pyarrow's ``open_input_stream`` inflates by suffix unless told not to: a real ``.gz``
    arrived inflated (then "the objects changed while they were being fetched", twice), and
    plain text named ``.gz`` failed as if the store were at fault."""
    import bz2
    import gzip
    import hashlib

    model = models["tiny"]
    text = b"plain text, not compressed at all\n" * 64
    stored = {
        "extra/vocab.txt.gz": gzip.compress(text),  # really gzip
        "notes.gz": text,  # only looks compressed
        "extra/merges.txt.bz2": bz2.compress(text),
        "extra/table.zst": _pyarrow_compressed(text, "zstd"),
        "extra/table.lz4": _pyarrow_compressed(text, "lz4"),
        "extra/table.br": _pyarrow_compressed(text, "brotli"),
    }
    uri = upload(s3env.client(), model, "llm/suffixes", **stored)
    r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    got = files_of(Path(r.local_dir))
    for rel, body in stored.items():
        assert hashlib.sha256(got[rel]).hexdigest() == hashlib.sha256(body).hexdigest(), rel
    recorded = json.loads((Path(r.local_dir) / MANIFEST).read_text())["files"]
    assert all(recorded[rel]["size"] == len(body) for rel, body in stored.items())
    # Control: the same reads with pyarrow's default (compression="detect") do not give the store's bytes.
    fs, prefix = fs_for(s3env.endpoint)(uri)
    with fs.open_input_stream(f"{prefix}/extra/vocab.txt.gz") as f:
        assert f.read() == text  # inflated: 2176 bytes where 74 are stored
    with pytest.raises((OSError, ValueError)), fs.open_input_stream(f"{prefix}/notes.gz") as f:
        f.read()  # "zlib inflate failed: incorrect header check"


# --------------------------------------------------------------------------- staleness


def test_a_changed_object_is_fetched_again_not_served_stale(s3env, models, tmp_path):
    model = models["tiny"]
    client = s3env.client()
    uri = upload(client, model, "llm/changing")
    first = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    again = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    assert again.reused and again.fetched_files == 0 and again.local_dir == first.local_dir
    client.put_object(Bucket=BUCKET, Key="llm/changing/generation_config.json", Body=b'{"changed": true, "x": 1}')
    third = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    assert not third.reused and third.local_dir != first.local_dir  # a new version, never rewritten in place
    assert json.loads((Path(third.local_dir) / "generation_config.json").read_text()) == {"changed": True, "x": 1}
    assert (Path(first.local_dir) / "generation_config.json").read_bytes() == (
        model.local / "generation_config.json"
    ).read_bytes()  # this process still holds the first version: untouched


def _old_reuse_key(listing) -> dict[str, list]:
    """What the previous code compared to decide reuse: key -> [size, mtime_ns]."""
    return {f.key: [f.size, f.mtime_ns] for f in listing.nonweights}


def test_a_same_size_change_within_the_same_second_is_not_served_stale(s3env, models, tmp_path):
    model = models["tiny"]
    client = s3env.client()
    fsp = fs_for(s3env.endpoint)
    a, b = b'{"temperature": 0.1}', b'{"temperature": 0.9}'
    assert len(a) == len(b)
    for _attempt in range(5):  # S3 gives LastModified to the second: retry until both land in one
        uri = upload(client, model, "llm/same-second", **{"generation_config.json": a})
        first = fetch_nonweights(uri, "runai_streamer", fs_and_path=fsp, root=tmp_path)
        before = list_model(uri, fsp)
        client.put_object(Bucket=BUCKET, Key="llm/same-second/generation_config.json", Body=b)
        after = list_model(uri, fsp)
        if _old_reuse_key(before) == _old_reuse_key(after):
            break
        time.sleep(0.3)
    else:
        pytest.fail("could not make two uploads within one second")
    # Control: size and mtime are identical, so the old size+mtime manifest would have reused.
    assert _old_reuse_key(before) == _old_reuse_key(after)
    second = fetch_nonweights(uri, "runai_streamer", fs_and_path=fsp, root=tmp_path)
    assert not second.reused and second.local_dir != first.local_dir
    assert (Path(second.local_dir) / "generation_config.json").read_bytes() == b  # the bytes served
    etags = {json.loads((Path(d) / MANIFEST).read_text())["files"]["generation_config.json"]["id"]
             for d in (first.local_dir, second.local_dir)}
    assert len(etags) == 2 and all(e.startswith("etag:") for e in etags)  # decided by the ETag


def test_the_same_uri_on_two_stores_gets_two_directories(s3env, models, tmp_path, tmp_path_factory):
    model = models["tiny"]
    other = start_s3_server(tmp_path_factory.mktemp("moto-b"))
    try:
        ca, cb = s3env.client(), other.client()
        cb.create_bucket(Bucket=BUCKET)
        a_cfg, b_cfg = b'{"store": "prod...."}', b'{"store": "staging."}'  # same size, same key
        uri = upload(ca, model, "llm/two-stores", **{"generation_config.json": a_cfg})
        assert upload(cb, model, "llm/two-stores", **{"generation_config.json": b_cfg}) == uri
        ra = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
        rb = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(other.endpoint), root=tmp_path)
        # The previous layout keyed the directory by the URI alone, and the URI is the same.
        assert ra.local_dir != rb.local_dir and not rb.reused
        assert (Path(ra.local_dir) / "generation_config.json").read_bytes() == a_cfg  # not rewritten by B
        assert (Path(rb.local_dir) / "generation_config.json").read_bytes() == b_cfg
        again = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
        assert again.reused and again.local_dir == ra.local_dir
        stores = {json.loads((Path(d) / MANIFEST).read_text())["store"] for d in (ra.local_dir, rb.local_dir)}
        assert stores == {f"s3|{s3env.endpoint}|signed", f"s3|{other.endpoint}|signed"}
    finally:
        other.stop()


def test_a_reader_keeps_its_snapshot_while_a_refetch_runs(s3env, models, shared_tmp):
    model = models["tiny"]
    client = s3env.client()
    uri = upload(client, model, "llm/held")
    root = shared_tmp / "cache"
    reader = start_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(root)}, child_env(s3env, shared_tmp),
                         hold=True)
    try:
        held = json.loads(reader.stdout.readline())
        assert "local_dir" in held, reader.stderr.read()
        old = Path(held["local_dir"])
        original = files_of(old)
        client.put_object(Bucket=BUCKET, Key="llm/held/config.json", Body=b'{"model_type": "llama", "v": 2}')
        new = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=root)
        assert Path(new.local_dir) != old and not new.reused
        assert files_of(old) == original  # not renamed away, not deleted, not rewritten
        reader.stdin.write("read\n")
        reader.stdin.flush()
        seen = json.loads(reader.stdout.readline())
        assert seen["config.json"] == __import__("hashlib").sha256(original["config.json"]).hexdigest()
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
    # Control: once nobody holds it, the next fetch removes the old version (so the hold is
    # what kept it). This process holds the new one, which stays.
    again = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=root)
    assert again.reused and again.local_dir == new.local_dir
    assert not old.exists() and [p.name for p in snapshot_dirs(root)] == [Path(new.local_dir).name]


# --------------------------------------------------------------------------- shared caches


def test_a_snapshot_planted_by_another_user_is_not_served(s3env, models, shared_tmp, caplog, monkeypatch):
    """uid 65534 fetches into a shared cache first and tampers with its snapshot (same size,
    plus remote code); root, sharing that cache, must get the bucket's bytes."""
    model = models["tiny"]
    (shared_tmp / "root-tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(shared_tmp / "root-tmp"))  # where the private fallback goes
    monkeypatch.setattr(tempfile, "tempdir", None)
    uri = upload(s3env.client(), model, "llm/planted")
    shared = shared_tmp / "hf-shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a shared cache dir, as on a multi-tenant node
    out, err = run_child({"uri": uri, "endpoint": s3env.endpoint, "root": str(shared)},
                         child_env(s3env, shared_tmp), uid=NOBODY)
    assert "local_dir" in out and out["uid"] == NOBODY and not out["private"], (out, err)
    planted = Path(out["local_dir"])
    genuine = (model.local / "config.json").read_bytes()
    evil = genuine.replace(b'"llama"', b'"evil!"')
    assert len(evil) == len(genuine) and evil != genuine
    (planted / "config.json").write_bytes(evil)
    (planted / "configuration_evil.py").write_text("import os; os.system('id')\n")
    os.chown(planted / "config.json", NOBODY, NOBODY)
    # Control: the planted snapshot passes every content check the manifest can make
    # (sizes, identities), which is all the previous code looked at.
    listing = list_model(uri, fs_for(s3env.endpoint))
    recorded = json.loads((planted / MANIFEST).read_text())["files"]
    assert {k: v["size"] for k, v in recorded.items()} == {f.key: f.size for f in listing.nonweights}
    assert all((planted / k).stat().st_size == v["size"] for k, v in recorded.items())

    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=shared)
    served = Path(r.local_dir)
    assert r.private and served != planted and shared not in served.parents
    assert served.parent == shared_tmp / "root-tmp" / f"ray-runai-shim-{os.getuid()}" / cache.DIR_NAME
    assert (served / "config.json").read_bytes() == genuine and not (served / "configuration_evil.py").exists()
    assert served.parent.stat().st_uid == 0 and served.parent.parent.stat().st_mode & 0o077 == 0
    warning = "\n".join(rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING)
    assert str(shared / cache.DIR_NAME) in warning and "uid 65534" in warning and "RAY_RUNAI_SHIM_CACHE_DIR" in warning
    assert planted.exists() and (planted / "config.json").read_bytes() == evil  # theirs, left alone


def test_an_unwritable_cache_dir_fetches_into_a_private_dir_not_the_full_model(s3env, models, shared_tmp):
    model = models["tiny"]
    uri = upload(s3env.client(), model, "llm/readonly")
    hub = shared_tmp / "hf" / "hub"
    hub.mkdir(parents=True)
    tmpdir = shared_tmp / "tmp"
    tmpdir.mkdir()
    for d in (shared_tmp / "hf", hub, tmpdir):
        os.chown(d, NOBODY, NOBODY)
    hub.chmod(0o555)  # the user's own cache, read-only
    out, err = run_child({"uri": uri, "endpoint": s3env.endpoint, "probe_write": str(hub)},
                         child_env(s3env, shared_tmp, HF_HOME=str(shared_tmp / "hf"), TMPDIR=str(tmpdir)),
                         uid=NOBODY)
    # Control: this user cannot write the cache; the previous code's mkdir raised there, which
    # Ray's wrapper logged as "failed unexpectedly" before running the full download.
    assert out["writable"] is False and out["old_mkdir"] == "PermissionError"
    assert "local_dir" in out and out["private"], (out, err)
    served = Path(out["local_dir"])
    assert served.parent == tmpdir / f"ray-runai-shim-{NOBODY}" / cache.DIR_NAME
    assert files_of(served) == {rel: (model.local / rel).read_bytes() for rel in model.nonweights}
    assert f"cannot create {hub / cache.DIR_NAME}" in err and "RAY_RUNAI_SHIM_CACHE_DIR" in err
    assert "WARNING" in err and "failed unexpectedly" not in err
    assert find_weight_bytes([shared_tmp], model.weight_paths()) == []  # no weight byte anywhere


def test_a_lock_held_past_its_timeout_fetches_privately(s3env, models, tmp_path, monkeypatch, caplog):
    import fcntl

    model = models["tiny"]
    uri = upload(s3env.client(), model, "llm/locked")
    monkeypatch.setenv("RAY_RUNAI_SHIM_LOCK_TIMEOUT", "1s")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    fsp = fs_for(s3env.endpoint)
    # Another process's fetch lock on this (store, URI), never released.
    from ray_runai_shim.stores.endpoint import store_identity

    store = store_identity(fsp(uri)[0], uri)
    base = tmp_path / "cache" / cache.DIR_NAME
    base.mkdir(parents=True)
    lock = base / f".{cache.group_name(uri, store.key())}.fetch-lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl,sys,time\nf=open({str(lock)!r},'w')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with open(lock) as probe:  # control: the lock really is held
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
            start = time.monotonic()
            r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fsp, root=tmp_path / "cache")
        assert time.monotonic() - start < 20
        assert r.private and Path(r.local_dir).parent == tmp_path / "tmp" / f"ray-runai-shim-{os.getuid()}" / cache.DIR_NAME
        assert (Path(r.local_dir) / "config.json").read_bytes() == (model.local / "config.json").read_bytes()
        warning = "\n".join(rec.getMessage() for rec in caplog.records)
        assert str(lock) in warning and "RAY_RUNAI_SHIM_LOCK_TIMEOUT" in warning
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- pre-checks


def test_hostile_object_keys_are_refused_before_anything_is_written(s3env, models, tmp_path):
    client = s3env.client()
    client.upload_file(str(models["tiny"].local / "model.safetensors"), BUCKET, "llm/hostile/model.safetensors")
    client.put_object(Bucket=BUCKET, Key="llm/hostile/config.json", Body=b"{}")
    client.put_object(Bucket=BUCKET, Key="llm/hostile/../../escape.py", Body=b"print('pwned')")
    uri = f"s3://{BUCKET}/llm/hostile"
    listed = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="llm/hostile")["Contents"]]
    if not any(".." in k for k in listed):
        pytest.fail(f"the S3 server normalised the key, the test cannot exercise it: {listed}")
    with pytest.raises(ShimError, match="refusing object key"):
        fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    assert not (tmp_path / "escape.py").exists()
    assert snapshot_dirs(tmp_path) == []


def test_safetensors_only_in_sub_folders_fail_before_anything_is_fetched(s3env, models, tmp_path):
    model = models["tiny"]
    client = s3env.client()
    for rel in model.nonweights:
        client.upload_file(str(model.local / rel), BUCKET, f"llm/nested/{rel}")
    for sub in ("original", "lora"):
        client.upload_file(str(model.local / "model.safetensors"), BUCKET, f"llm/nested/{sub}/model.safetensors")
    uri = f"s3://{BUCKET}/llm/nested"
    mark = len(s3env.requests())
    listing = list_model(uri, fs_for(s3env.endpoint))
    # Control: the previous pre-check (any key ending in .safetensors) passed this prefix.
    assert any(f.key.endswith(".safetensors") for f in listing.weights)
    with pytest.raises(ShimError) as err:
        fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    msg = str(err.value)
    assert "lora/model.safetensors" in msg and "original/model.safetensors" in msg and "sub-folders" in msg
    assert snapshot_dirs(tmp_path) == []
    assert not [r for r in s3env.requests(mark) if r.method == "GET" and "/llm/nested/" in r.path]
    # tensorizer reads <uri>/model.tensors exactly: a nested or differently named file fails too.
    client.put_object(Bucket=BUCKET, Key="llm/nested/original/model.tensors", Body=b"\0" * 64)
    with pytest.raises(ShimError, match=r"reads s3://models/llm/nested/model\.tensors.*original/model\.tensors"):
        fetch_nonweights(uri, "tensorizer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    client.put_object(Bucket=BUCKET, Key="llm/nested/model.tensors", Body=b"\0" * 64)
    fetch_nonweights(uri, "tensorizer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)  # control


def test_a_prefix_without_config_json_fails_at_listing_time(s3env, models, tmp_path):
    """#27: weights without config.json were fetched as a snapshot, and vLLM failed only after
    the engine had started."""
    model = models["tiny"]
    client = s3env.client()
    for rel in model.nonweights + model.weights:
        if rel != "config.json":
            client.upload_file(str(model.local / rel), BUCKET, f"llm/no-config/{rel}")
    client.upload_file(str(model.local / "config.json"), BUCKET, "llm/no-config/base/config.json")
    uri = f"s3://{BUCKET}/llm/no-config"
    fsp = fs_for(s3env.endpoint)
    # Control: nothing else is wrong with the prefix; the previous fetch went on from this listing.
    listing = list_model(uri, fsp)
    assert listing.weights and "config.json" not in {f.key for f in listing.nonweights}
    mark = len(s3env.requests())
    with pytest.raises(ShimError) as err:
        fetch_nonweights(uri, "runai_streamer", fs_and_path=fsp, root=tmp_path / "cache")
    msg = str(err.value)
    assert f"{uri} has no config.json at the top of the prefix" in msg and "after the engine started" in msg
    assert "Fix: point model_source at the folder that holds config.json" in msg
    assert f"use {uri}/base" in msg  # the folder that does hold one
    assert not (tmp_path / "cache").exists()  # nothing written, not even the cache directory
    assert [(r.method, r.path) for r in s3env.requests(mark)] == [("GET", f"/{BUCKET}")]  # the listing only
    # A tokenizer-only download ("auto") needs no config.json and is still served.
    r = fetch_nonweights(uri, "auto", fs_and_path=fsp, root=tmp_path / "cache")
    assert (Path(r.local_dir) / "tokenizer_config.json").exists()


def test_config_json_check_accepts_params_json_and_hf_config_path():
    from ray_runai_shim.snapshot.fetch import Listing, RemoteFile, check_model_config
    from ray_runai_shim.snapshot.nonweights import _check_recorded

    weights = [RemoteFile("consolidated.safetensors", 8, None)]
    check_model_config(Listing("s3://b/m", [RemoteFile("params.json", 2, None)], weights))  # Mistral's format
    check_model_config(Listing("s3://b/m", [], weights), {"hf_config_path": "s3://b/base"})
    with pytest.raises(ShimError, match="no config.json"):
        check_model_config(Listing("s3://b/m", [RemoteFile("tokenizer.json", 2, None)], weights))
    # A job's record made by a tokenizer-only download is checked when the vLLM stage reuses it.
    from ray_runai_shim.context import StageContext

    ctx = StageContext(model="s3://b/m", load_format="runai_streamer", engine_kwargs={})
    with pytest.raises(ShimError, match="no config.json"):
        _check_recorded(ctx, "runai_streamer", [["model.safetensors", 8]], ["tokenizer.json"])
    _check_recorded(ctx, "runai_streamer", [["model.safetensors", 8]], ["config.json"])
    _check_recorded(ctx, "runai_streamer", [["model.safetensors", 8]], None)  # a record from before: unknown


@pytest.mark.parametrize(
    "uri,after,fixed",
    [
        (f"s3://{BUCKET}//llm/tiny", BUCKET, f"s3://{BUCKET}/llm/tiny"),
        (f"s3://{BUCKET}/llm//tiny", f"{BUCKET}/llm", f"s3://{BUCKET}/llm/tiny"),
        (f"s3://anonymous@{BUCKET}/llm//tiny/", f"{BUCKET}/llm", f"s3://anonymous@{BUCKET}/llm/tiny"),
    ],
)
def test_empty_path_segments_are_refused_before_any_request(s3env, models, tmp_path, uri, after, fixed):
    """#27: pyarrow refuses them itself ("Empty path component in path …"), a text the shim did
    not recognise, so the message sent the user to the bucket name and the credentials."""
    from ray_runai_shim.diagnostics.diagnose import classify_store

    mark = len(s3env.requests())
    with pytest.raises(ShimError) as err:
        fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path / "cache")
    msg = str(err.value)
    assert f"the model URI {uri} has an empty path segment ('//' after '{after}')" in msg
    assert f"Fix: write {fixed} (one '/' between segments)" in msg
    assert "credentials" not in msg and "store said" not in msg
    assert s3env.requests(mark) == [] and not (tmp_path / "cache").exists()
    # Control: pyarrow's own words for it carry no cause the shim knows (the old "no reason" message).
    import pyarrow.fs as pa_fs

    with pytest.raises(ValueError) as raw:
        fs_for(s3env.endpoint)(uri)[0].get_file_info(pa_fs.FileSelector(f"{BUCKET}/llm//tiny"))
    assert "Empty path component" in str(raw.value) and classify_store(str(raw.value)) == "unknown"
    if "anonymous" not in uri:  # and the URI written as the message says works
        assert fetch_nonweights(fixed, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path).local_dir


def test_credentials_in_the_model_uri_are_refused_before_any_request(s3env, tmp_path):
    mark = len(s3env.requests())
    with pytest.raises(ShimError) as err:
        list_model(f"s3://AKIAMODELURI:model-uri-secret@{BUCKET}/llm/tiny", fs_for(s3env.endpoint))
    msg = str(err.value)
    assert "carries credentials before the bucket name" in msg and "do not belong in the model URI" in msg
    assert "model-uri-secret" not in msg and "AKIAMODELURI" not in msg and s3env.requests(mark) == []


# --------------------------------------------------------------------------- store errors


def test_missing_bucket_and_unreachable_endpoint_name_the_cause_and_fix(s3env, tmp_path, monkeypatch):
    with pytest.raises(ShimError) as err:
        fetch_nonweights("s3://no-such-bucket/m", "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    msg = str(err.value)
    assert "s3://no-such-bucket/m" in msg and s3env.endpoint in msg and "testing" not in msg
    assert "no such bucket" in msg and "NO_SUCH_BUCKET" in msg  # cause, and the store's own words

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(ShimError) as err:
        fetch_nonweights(f"s3://{BUCKET}/llm/tiny", "runai_streamer", fs_and_path=fs_for(dead), root=tmp_path)
    msg = str(err.value)
    assert dead in msg and f"s3://{BUCKET}/llm/tiny" in msg
    assert "nothing accepted the connection" in msg and "credentials" not in msg.split("(store said")[0]
    assert list(tmp_path.iterdir()) in ([], [tmp_path / cache.DIR_NAME])


def test_anonymous_uri_is_mapped_to_the_streamers_unsigned_mode():
    from ray_runai_shim.snapshot.handoff import streamer_uri

    assert streamer_uri("s3://anonymous@public-bucket/m") == (
        "s3://public-bucket/m",
        {"RUNAI_STREAMER_S3_UNSIGNED": "1"},
    )
    assert streamer_uri("s3://bucket/m") == ("s3://bucket/m", {})


@pytest.fixture(scope="module")
def strict_s3(tmp_path_factory, models):
    """A moto server of its own with IAM auth enforced, the tiny model in it, and a user
    who may list the bucket but not read objects."""
    from support.fixtures import upload_models

    server = start_s3_server(tmp_path_factory.mktemp("moto-strict"))
    try:
        server.client().create_bucket(Bucket=BUCKET)
        upload_models(server)
        server.lister = server.iam_user("lister", ["s3:ListBucket"])
        server.reader = server.iam_user("reader", ["s3:ListBucket", "s3:GetObject"])
        server.enforce_auth()
        yield server
    finally:
        server.stop()


def _creds_env(strict, home: Path, key: Optional[str], secret: Optional[str]) -> dict[str, str]:
    env = child_env(strict, home, AWS_SHARED_CREDENTIALS_FILE=str(home / "none"), AWS_CONFIG_FILE=str(home / "none"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    if key:
        env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    return env


def test_a_worker_without_credentials_is_told_to_give_it_an_identity(strict_s3, shared_tmp):
    uri = f"s3://{BUCKET}/llm/tiny"
    args = {"uri": uri, "endpoint": strict_s3.endpoint, "root": str(shared_tmp / "cache")}
    out, _ = run_child(args, _creds_env(strict_s3, shared_tmp, None, None))
    msg = out.get("error", "")
    assert out.get("type") == "ShimError", out
    assert uri in msg and strict_s3.endpoint in msg
    assert "No credentials are visible to this worker" in msg  # the cause
    assert "instance profile" in msg and "AWS_ACCESS_KEY_ID" in msg  # how to give it an identity
    assert "never sends the driver's credentials" in msg  # and why the driver's do not help
    assert "reachable" not in msg
    assert not (shared_tmp / "cache").exists() or snapshot_dirs(shared_tmp / "cache") == []
    # Control: with the reader's credentials the same child succeeds (auth is what failed it).
    ok, err = run_child(args, _creds_env(strict_s3, shared_tmp, *strict_s3.reader))
    assert "local_dir" in ok, (ok, err)


def test_list_only_credentials_name_the_missing_read_permission(strict_s3, shared_tmp):
    uri = f"s3://{BUCKET}/llm/tiny"
    key, secret = strict_s3.lister
    out, err = run_child({"uri": uri, "endpoint": strict_s3.endpoint, "root": str(shared_tmp / "cache")},
                         _creds_env(strict_s3, shared_tmp, key, secret))
    msg = out.get("error", "")
    assert out.get("type") == "ShimError", out
    assert "access denied" in msg and "could list the prefix but may not read" in msg and "s3:GetObject" in msg
    assert "ACCESS_DENIED" in msg and "AWS_ACCESS_KEY_ID" in msg  # the store's words, the identity's source
    assert secret not in msg and secret not in err
    assert snapshot_dirs(shared_tmp / "cache") == []


def test_rejected_credentials_name_the_uri_and_endpoint_never_the_secret(strict_s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", strict_s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", strict_s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-value")
    with pytest.raises(ShimError) as err:
        fetch_nonweights(f"s3://{BUCKET}/llm/tiny", "runai_streamer", fs_and_path=fs_for(strict_s3.endpoint),
                         root=tmp_path / "cache")
    msg = str(err.value)
    assert f"s3://{BUCKET}/llm/tiny" in msg and strict_s3.endpoint in msg
    assert "not-a-real-secret-value" not in msg
    assert "INVALID_ACCESS_KEY_ID" in msg and "access key id is unknown to this store" in msg
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def _raw_pyarrow_error(endpoint: str) -> str:
    """What pyarrow itself says when handed *endpoint* unchecked (the control)."""
    import pyarrow.fs as pa_fs

    raw = pa_fs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[1], scheme="http", access_key="testing",
                             secret_key="testing", region="us-east-1")
    with pytest.raises(OSError) as err:
        raw.get_file_info(pa_fs.FileSelector(f"{BUCKET}/llm/tiny", recursive=True))
    return str(err.value)


def test_credentials_in_the_endpoint_url_never_appear_in_errors_or_logs(s3env, models, tmp_path, monkeypatch, caplog):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    endpoint = f"http://AKIAUSERINFO:userinfo-secret-42@127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"), pytest.raises(ShimError) as err:
        fetch_nonweights(f"s3://{BUCKET}/llm/tiny", "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
    msg = str(err.value)
    shown = "".join(traceback.format_exception(err.type, err.value, err.tb))  # what Ray prints, chain included
    assert f"http://127.0.0.1:{port}" in msg  # the endpoint is still named
    # Control: pyarrow's own text quotes the user part (curl takes it for the host name).
    assert "AKIAUSERINFO" in _raw_pyarrow_error(endpoint)
    for secret in ("userinfo-secret-42", "AKIAUSERINFO"):
        assert secret not in shown and secret not in caplog.text and secret not in repr(err.value.args)


def test_credentials_in_the_endpoint_url_are_refused_before_any_request(s3env, models, tmp_path, monkeypatch):
    """#27: an unencoded "@" in the secret was masked only up to its first "@", and any
    user-info reached pyarrow, so a live store read as "the host name does not resolve"."""
    from ray_runai_shim.diagnostics.diagnose import classify_store

    endpoint = f"http://AKIA:se@cret@127.0.0.1:{s3env.port}"  # the store is up and reachable
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    mark = len(s3env.requests())
    with pytest.raises(ShimError) as err:
        fetch_nonweights(models["tiny"].uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
    msg = str(err.value)
    assert "AWS_ENDPOINT_URL_S3 carries credentials in its user-info" in msg
    assert "do not belong in the endpoint URL" in msg and f"set AWS_ENDPOINT_URL_S3 to http://127.0.0.1:{s3env.port}" in msg
    assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in msg and "instance profile" in msg  # where they go
    assert "does not resolve" not in msg and "store said" not in msg
    for piece in ("se@cret", "cret@", "AKIA:"):
        assert piece not in msg and piece not in repr(err.value.args)
    assert s3env.requests(mark) == []  # refused before any request
    assert not (tmp_path / cache.DIR_NAME).exists()  # nothing written
    # Control: handed on as it was, the same endpoint against the same live server reads as DNS.
    raw = _raw_pyarrow_error(endpoint)
    assert "Could not resolve host: AKIA" in raw and classify_store(raw) == "dns"
