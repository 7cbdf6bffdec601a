"""The node relay is safe to leave on: nothing outlives its readers, no copy is torn or stale,
no other account can stop or redirect it, and a copy that fails never fails a reader.

Real processes (SIGKILL, ``fork`` and ``spawn`` children, a second local account), a real S3
server (moto) behind the counting/stalling proxy where timing matters, a real tmpfs. Each
test has its control: the failure as it is without the rule under test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import overwrite, shm
from support.fixtures import BUCKET
from support.procs import base_env
from support.proxy import CountingProxy

from ray_runai_shim import doctor
from ray_runai_shim.errors import ShimError
from ray_runai_shim.integrations.relay_budget import check_memory_limit
from ray_runai_shim.snapshot import locks, memory, relay, relay_copy
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

MIB = 1 << 20
HOLDER = Path(__file__).resolve().parents[1] / "support" / "relayhold.py"
NOBODY = 65534


def _upload(s3, prefix: str, sizes: dict[str, int], seed: int) -> dict:
    client = s3.client()
    rng = __import__("random").Random(seed)
    blobs = {name: rng.randbytes(size) for name, size in sizes.items()}
    for name, data in blobs.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/config.json", Body=b"{}")
    return {"uri": f"s3://{BUCKET}/{prefix}", "blobs": blobs, "bytes": sum(sizes.values()), "prefix": prefix}


@pytest.fixture(scope="module")
def two_models(s3, models):
    """Two small checkpoints of two shards each (the relay reads bytes, not tensors)."""
    shards = {"model-00001-of-00002.safetensors": 6 * MIB, "model-00002-of-00002.safetensors": 3 * MIB}
    return _upload(s3, "safety/a", shards, 1), _upload(s3, "safety/b", shards, 2)


@pytest.fixture
def s3env(monkeypatch, s3):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def relay_dir(monkeypatch, s3env):
    with shm.tmpdir("rrs-relay-safety-") as d:
        monkeypatch.setenv(relay.RELAY_DIR, str(d))
        yield d


def fs_for(endpoint: str):
    return lambda uri: (endpoint_s3_filesystem(False, endpoint), uri.split("://", 1)[1])


def holder(s3, model: dict, relay_dir: Path, then: str, **args) -> subprocess.Popen:
    env = base_env({**s3.env(), relay.RELAY_DIR: str(relay_dir)})
    payload = {"uri": model["uri"], "endpoint": s3.endpoint, "then": then, **args}
    return subprocess.Popen([sys.executable, str(HOLDER), json.dumps(payload)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def next_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line.startswith("{"), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
    return json.loads(line)


def copies_in(relay_dir: Path) -> list[str]:
    base = relay_dir / f"ray-runai-shim-relay-{os.getuid()}"
    return sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []


# --------------------------------------------------------------------------- nothing outlives its readers


def test_a_reader_killed_with_sigkill_leaves_no_copy_past_the_next_use(s3, two_models, relay_dir, monkeypatch):
    a, b = two_models
    victim = holder(s3, a, relay_dir, "hold")
    held = Path(next_line(victim)["path"])
    os.kill(victim.pid, signal.SIGKILL)  # the OOM killer, ray.kill, a node drain
    victim.wait()
    # Control: the kill alone frees nothing; the copy stays in memory, and doctor says so.
    assert held.is_dir() and copies_in(relay_dir) == [held.name]
    report = doctor.node_report()
    assert [c["held"] for c in report["relay_copies"]] == [False]
    assert a["bytes"] <= report["relay_copies"][0]["bytes"] < a["bytes"] + 4096  # the weights and the marker
    assert "0 held by a reader, 1 held by nothing (9.0 MiB of memory" in doctor.render(
        {**_doctor_stub(), "node": report})

    got = relay.acquire(b["uri"], fs_for(s3.endpoint))  # the next use of the node's relay, another model
    try:
        assert got is not None and not held.exists()  # the dead reader's copy is gone
        assert copies_in(relay_dir) == [got.path.name]
    finally:
        assert relay.release(got) is True
    assert not (relay_dir / f"ray-runai-shim-relay-{os.getuid()}").exists()  # nothing left, not even locks


def test_two_readers_letting_go_at_once_both_return(s3, two_models, relay_dir, monkeypatch):
    """The last two readers of a copy release together: one sweeps and tidies the directory
    away while the other is between its sweep and its tidy. Both return; nothing is left."""
    a, _ = two_models
    first = relay.acquire(a["uri"], fs_for(s3.endpoint))
    second = relay.acquire(a["uri"], fs_for(s3.endpoint))
    assert first is not None and second is not None and first.path == second.path
    base = first.path.parent
    assert relay.release(first) is False  # the second still holds it
    real_sweep = relay.sweep

    def other_reader_tidies_meanwhile(*args, **kwargs):
        freed = real_sweep(*args, **kwargs)
        (base / ".sweep").unlink(missing_ok=True)  # what the other reader's _tidy does, first
        base.rmdir()
        return freed

    monkeypatch.setattr(relay, "sweep", other_reader_tidies_meanwhile)
    assert relay.release(second) is True
    assert not base.exists()
    # Control: the lock file the tidy used to open unguarded cannot be made in a directory gone.
    with pytest.raises(FileNotFoundError):
        locks.flock_path(base / ".sweep", __import__("fcntl").LOCK_EX, deadline=0)


def _doctor_stub() -> dict:
    return {"versions": {}, "plan": {"ray": None, "why": "", "patches": []},
            "this_process": {"installed": False}, "workers": "", "environment": {},
            "activation": {"route": "", "submitted_job": False, "override": False, "adds": [], "warning": None}}


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_children_of_a_reader_never_keep_the_copy_held(s3, two_models, relay_dir, start):
    a, _ = two_models
    proc = holder(s3, a, relay_dir, start)
    try:
        path = Path(next_line(proc)["path"])
        done = next_line(proc)
        # The reader's load is done while its child (vLLM's engine core, a TP worker) lives on.
        assert done["freed"] is True and not done["exists"] and not path.exists()
        assert Path(f"/proc/{done['child']}").exists()
    finally:
        _end(proc)
    if start == "spawn":
        return
    # Control: the same fork without the shim's at-fork rule: the child shares the lock's open
    # file, so the reader's release frees nothing while the child lives.
    proc = holder(s3, a, relay_dir, "fork", inherit_locks=True)
    try:
        path = Path(next_line(proc)["path"])
        done = next_line(proc)
        assert done["freed"] is False and path.exists()
    finally:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """End a holder and the child it started (both ours)."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    proc.kill()
    for k in kids:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass
    proc.communicate(timeout=30)


def test_keep_is_a_node_total_least_recently_used_first(s3, two_models, relay_dir, monkeypatch):
    a, b = two_models
    monkeypatch.setenv(relay.RELAY_KEEP, str(a["bytes"] + MIB))  # room for one copy, not two
    fs = fs_for(s3.endpoint)
    first = relay.acquire(a["uri"], fs)
    relay.release(first)
    assert copies_in(relay_dir) == [first.path.name]  # kept for a restart
    second = relay.acquire(b["uri"], fs)
    relay.release(second)
    assert copies_in(relay_dir) == [second.path.name]  # the total holds: the older one went
    again = relay.acquire(a["uri"], fs)  # a copy evicted is fetched again, and now b is the older
    assert again.fetched
    relay.release(again)
    assert copies_in(relay_dir) == [again.path.name]
    monkeypatch.setenv(relay.RELAY_KEEP, "0")
    relay.sweep(relay.root())
    assert copies_in(relay_dir) == []


# --------------------------------------------------------------------------- never torn, never stale


def test_an_object_overwritten_mid_copy_is_never_served(s3, relay_dir, monkeypatch, caplog):
    shard = "model-00001-of-00001.safetensors"
    model = _upload(s3, "safety/torn", {shard: 6 * MIB}, 3)
    new = bytes(b ^ 0xFF for b in model["blobs"][shard])  # same size, new content: size and length checks pass
    monkeypatch.setattr(relay_copy, "RANGE_BYTES", MIB)
    monkeypatch.setattr(relay_copy, "WORKERS", 1)  # one range after another: the overwrite lands between them

    def copy_while_overwritten():
        base = relay.root()
        with CountingProxy(s3.port) as proxy:
            proxy.stall(shard, 2.0)  # the first range's reply pauses; the store's object changes meanwhile

            t = overwrite.when_copying(
                base, lambda: s3.client().put_object(Bucket=BUCKET, Key=f"{model['prefix']}/{shard}", Body=new))
            try:
                return relay.acquire(model["uri"], fs_for(proxy.endpoint))
            finally:
                t.join()
                s3.client().put_object(Bucket=BUCKET, Key=f"{model['prefix']}/{shard}", Body=model["blobs"][shard])

    with caplog.at_level(logging.WARNING, logger="ray_runai_shim"):
        assert copy_while_overwritten() is None  # refused: the readers stream
    said = [r.getMessage() for r in caplog.records if "streams from the store instead" in r.getMessage()]
    assert len(said) == 1 and f"{shard} changed while the node relay copied it" in said[0], said
    assert copies_in(relay_dir) == []

    # Control: the same copy without the version pin is served, and it is neither version.
    monkeypatch.setattr(relay_copy, "PIN_VERSIONS", False)
    got = copy_while_overwritten()
    try:
        data = (got.path / shard).read_bytes()
        assert data != model["blobs"][shard] and data != new
        head = relay_copy.HEAD_BYTES  # the first range read, the one the store stalled on
        assert data[:head] == model["blobs"][shard][:head] and data[-MIB:] == new[-MIB:]  # torn
    finally:
        relay.release(got)


def test_the_key_holds_each_objects_identity_and_the_reading_account(s3, two_models, relay_dir, monkeypatch):
    a, _ = two_models
    fs = fs_for(s3.endpoint)
    first = relay.acquire(a["uri"], fs)
    try:
        marker = json.loads((first.path / relay_copy.MARKER).read_text())
        etags = {s3.client().head_object(Bucket=BUCKET, Key=a["prefix"] + "/" + k)["ETag"] for k in a["blobs"]}
        assert {f["identity"] for f in marker["files"].values()} == {f"etag:{e}" for e in etags}
        assert "identity when listed, when opened and after its ranges landed" in marker["verified"]
        # Another tenant on the same node and uid, reading the same bucket as another account.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-tenant")
        other = relay.acquire(a["uri"], fs)
        try:
            assert other.fetched and other.path != first.path
        finally:
            relay.release(other)
    finally:
        relay.release(first)


# --------------------------------------------------------------------------- no other account in the way


def _as_nobody(*cmd: str) -> None:
    subprocess.run(cmd, check=True, preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local account")
def test_another_account_can_neither_stop_nor_redirect_the_relay(s3, s3env, two_models, relay_dir, tmp_path,
                                                                 monkeypatch, caplog):
    a, _ = two_models
    shared = relay_dir  # made world-writable and sticky, as /dev/shm is
    shared.chmod(0o1777)
    monkeypatch.setenv(relay.RELAY_DIR, str(shared))
    base = shared / f"ray-runai-shim-relay-{os.getuid()}"

    # 1. A squatted directory: the relay's path, created first by another account.
    _as_nobody("mkdir", "-m", "0777", str(base))
    with caplog.at_level(logging.WARNING, logger="ray_runai_shim"):
        assert relay.acquire(a["uri"], fs_for(s3.endpoint)) is None  # the engine still starts: it streams
    said = [r.getMessage() for r in caplog.records if "cannot use its directory" in r.getMessage()]
    assert len(said) == 1 and f"belongs to uid {NOBODY}" in said[0] and relay.RELAY_DIR in said[0]
    assert os.listdir(base) == []  # nothing of ours written into it
    assert os.access(base, os.W_OK)  # control: root could have written there, and the old check only refused
    _as_nobody("rmdir", str(base))

    # 2. A symlink planted at the relay's path, to a directory root owns: never followed.
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    _as_nobody("ln", "-s", str(victim), str(base))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ray_runai_shim"):
        assert relay.acquire(a["uri"], fs_for(s3.endpoint)) is None
    assert any("is a symlink" in r.getMessage() for r in caplog.records)
    assert os.listdir(victim) == []
    assert os.stat(base).st_uid == os.getuid()  # control: followed, the path looks like root's own directory


# --------------------------------------------------------------------------- a failed copy never fails a reader


def test_a_relay_directory_that_fills_up_leaves_nothing_and_says_so(s3, s3env, two_models, tmp_path, monkeypatch, caplog):
    a, _ = two_models
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    try:
        monkeypatch.setenv(relay.RELAY_DIR, str(mnt))
        # The fit check saw room that is gone when the copy starts (Ray's object store or NCCL took it).
        monkeypatch.setattr(memory, "HEADROOM_BYTES", -(1 << 30))
        with caplog.at_level(logging.WARNING, logger="ray_runai_shim"):
            assert relay.acquire(a["uri"], fs_for(s3.endpoint)) is None
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1, said
        assert f"the relay directory {mnt}/ray-runai-shim-relay-{os.getuid()} filled up" in said[0]
        assert relay.RELAY_DIR in said[0] and "MiB free" in said[0] and "shim bug" not in said[0]
        left = [p for p in mnt.rglob("*") if p.is_file() and p.stat().st_size > 0 and ".failed" not in p.name]
        assert left == []  # nothing partial
        # Control: the space really is not there for the weights.
        with pytest.raises(OSError, match="No space left"):
            with open(mnt / "probe.safetensors", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, 6 * MIB)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_memory_limit_the_streamer_cannot_read_is_named_before_the_engine_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", "4GB")
    with pytest.raises(ShimError, match=r"RUNAI_STREAMER_MEMORY_LIMIT='4GB' is not a limit .* whole number of bytes"):
        check_memory_limit(SimpleNamespace(model_loader_extra_config=None))
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", "4000000000")
    check_memory_limit(SimpleNamespace(model_loader_extra_config=None))
    with pytest.raises(ShimError, match=r'model_loader_extra_config\["memory_limit"\]=\'lots\''):
        check_memory_limit(SimpleNamespace(model_loader_extra_config={"memory_limit": "lots"}))

    # Control: the real streamer fails on it only when it loads, in words that do not say which setting.
    from safetensors.numpy import save_file

    save_file({"w": __import__("numpy").zeros(4, dtype="float32")}, str(tmp_path / "m.safetensors"))
    code = ("from runai_model_streamer import SafetensorsStreamer\n"
            "with SafetensorsStreamer() as s:\n"
            f"    s.stream_files([{str(tmp_path / 'm.safetensors')!r}])\n"
            "    list(s.get_tensors())\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RUNAI_STREAMER_MEMORY_LIMIT": "4GB"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid literal for int() with base 10: '4GB'" in out.stderr


def test_locks_are_not_inherited_by_forked_children(tmp_path):
    """The at-fork rule itself, in this process: a forked child closes the registered fds."""
    import fcntl

    fd = locks.flock_path(tmp_path / "lock", fcntl.LOCK_SH)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(fd)
                os.write(w, b"open")
            except OSError:
                os.write(w, b"closed")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 16) == b"closed"
    finally:
        locks.close(fd)
