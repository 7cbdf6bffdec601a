"""The narrowed fetch against the real S3 server: concurrency, faults, staleness."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
from pathlib import Path

import pytest
from support.fixtures import BUCKET

from ray_runai_shim.endpoint import endpoint_s3_filesystem
from ray_runai_shim.errors import ShimError
from ray_runai_shim.fetch import MANIFEST, fetch_nonweights, snapshot_dir


def fs_for(endpoint: str):
    def fs_and_path(uri: str):
        return endpoint_s3_filesystem(False, endpoint), uri.split("://", 1)[1]

    return fs_and_path


@pytest.fixture
def s3env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


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
    client = s3env.client()
    # A non-weight object big enough that the cut lands inside its body.
    big = os.urandom(3 << 20)
    client.put_object(Bucket=BUCKET, Key="llm/faulty/tokenizer.json", Body=big)
    for rel in model.nonweights:
        if rel != "tokenizer.json":
            client.upload_file(str(model.local / rel), BUCKET, f"llm/faulty/{rel}")
    client.upload_file(str(model.local / "model.safetensors"), BUCKET, "llm/faulty/model.safetensors")
    proxy = DroppingProxy(s3env.port, budget=1 << 20)
    endpoint = f"http://127.0.0.1:{proxy.port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    uri = f"s3://{BUCKET}/llm/faulty"
    try:
        with pytest.raises(ShimError, match="failed") as err:
            fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
        assert uri in str(err.value)
        dest = snapshot_dir(uri, tmp_path)
        assert not dest.exists()  # no snapshot a later run could take for complete
        leftovers = [p for p in dest.parent.iterdir() if not p.name.endswith(".lock")]
        assert leftovers == []  # no staging dir, no partial file under any name
        proxy.dropping = False
        r = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(endpoint), root=tmp_path)
        assert (Path(r.local_dir) / "tokenizer.json").read_bytes() == big
        assert not r.reused and r.fetched_files == len(model.nonweights)
    finally:
        proxy.close()


def test_a_changed_object_is_fetched_again_not_served_stale(s3env, models, tmp_path):
    model = models["tiny"]
    client = s3env.client()
    for rel in model.nonweights + model.weights:
        client.upload_file(str(model.local / rel), BUCKET, f"llm/changing/{rel}")
    uri = f"s3://{BUCKET}/llm/changing"
    first = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    again = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    assert again.reused and again.fetched_files == 0
    client.put_object(Bucket=BUCKET, Key="llm/changing/generation_config.json", Body=b'{"changed": true, "x": 1}')
    third = fetch_nonweights(uri, "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    assert not third.reused and third.local_dir == first.local_dir
    assert json.loads((Path(third.local_dir) / "generation_config.json").read_text()) == {"changed": True, "x": 1}


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
    assert not snapshot_dir(uri, tmp_path).exists()


def test_missing_bucket_and_unreachable_endpoint_name_the_uri_and_endpoint(s3env, tmp_path, monkeypatch):
    with pytest.raises(ShimError) as err:
        fetch_nonweights("s3://no-such-bucket/m", "runai_streamer", fs_and_path=fs_for(s3env.endpoint), root=tmp_path)
    msg = str(err.value)
    assert "s3://no-such-bucket/m" in msg and s3env.endpoint in msg and "testing" not in msg

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(ShimError) as err:
        fetch_nonweights(f"s3://{BUCKET}/llm/tiny", "runai_streamer", fs_and_path=fs_for(dead), root=tmp_path)
    assert dead in str(err.value) and f"s3://{BUCKET}/llm/tiny" in str(err.value)
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "ray-runai-shim"])


def test_anonymous_uri_is_mapped_to_the_streamers_unsigned_mode():
    from ray_runai_shim.patches import streamer_uri

    assert streamer_uri("s3://anonymous@public-bucket/m") == (
        "s3://public-bucket/m",
        {"RUNAI_STREAMER_S3_UNSIGNED": "1"},
    )
    assert streamer_uri("s3://bucket/m") == ("s3://bucket/m", {})


def test_rejected_credentials_name_the_uri_and_endpoint_never_the_secret(s3env, tmp_path, monkeypatch):
    from support.s3server import S3Server

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto: enforce IAM auth from request 1
    strict = S3Server(tmp_path / "strict.log").start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", strict.endpoint)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-value")
        with pytest.raises(ShimError) as err:
            fetch_nonweights(f"s3://{BUCKET}/llm/tiny", "runai_streamer", fs_and_path=fs_for(strict.endpoint),
                             root=tmp_path / "cache")
        msg = str(err.value)
        assert f"s3://{BUCKET}/llm/tiny" in msg and strict.endpoint in msg
        assert "not-a-real-secret-value" not in msg
        assert "INVALID_ACCESS_KEY_ID" in msg  # the store's own reason is kept
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))
    finally:
        strict.stop()
