"""The pipelined node relay: every reader starts on the bytes already on the node.

Real processes (``support/relaychild.py``: the relay, then what vLLM's rank does with a copy
in progress, ``integrations/runai_loader.as_it_lands``, and the real streamer otherwise), a
real S3 server (moto) behind the counting, rate-limiting and stalling proxy. What is
observed, not inferred: a follower holds tensors while the copy is still incomplete on disk.
Each test has its control: the same readers waiting for the whole copy, or without the rule.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import overwrite, shm
from support.checkpoints import digest, upload_model
from support.fixtures import BUCKET
from support.procs import base_env
from support.proxy import CountingProxy
from support.relaychild import CHILD

from ray_runai_shim.integrations.runai_loader import as_it_lands
from ray_runai_shim.snapshot import relay, relay_copy, relay_progress, relay_read
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

MIB = 1 << 20


@pytest.fixture(scope="module")
def checkpoints(s3, models, tmp_path_factory):
    """The same 12 MiB of float32 tensors as two shards and as one file (2 MiB tensors)."""
    six = {f"t{i}": (512, 1024) for i in range(6)}
    sharded = {"model-00001-of-00002.safetensors": dict(list(six.items())[:3]),
               "model-00002-of-00002.safetensors": dict(list(six.items())[3:])}
    return {"sharded": upload_model(s3, tmp_path_factory.mktemp("sharded"), "pipe/sharded", sharded, 11),
            "single": upload_model(s3, tmp_path_factory.mktemp("single"), "pipe/single",
                                    {"model.safetensors": six}, 11)}


@pytest.fixture
def relay_dir(monkeypatch, s3):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    with shm.tmpdir("rrs-relay-read-") as d:
        monkeypatch.setenv(relay.RELAY_DIR, str(d))
        yield d


def start_reader(s3, endpoint: str, model: dict, relay_dir: Path, **args) -> subprocess.Popen:
    env = base_env({**s3.env(), "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
                    relay.RELAY_DIR: str(relay_dir)})
    payload = {"uri": model["uri"], "endpoint": endpoint, "weights": model["weights"], "mode": "relay", **args}
    return subprocess.Popen([sys.executable, str(CHILD), json.dumps(payload)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, err[-3000:]
    result = json.loads(lines[-1])
    assert "error" not in result, (result, err[-3000:])
    result["stderr"] = err
    return result


def _marker_exists(relay_dir: Path) -> bool:
    try:
        return any(relay_dir.rglob(relay_copy.MARKER))
    except FileNotFoundError:  # the last reader removed the directory while we looked
        return False


def _live_record(relay_dir: Path):
    try:
        lives = [p for p in relay_dir.rglob("*.live") if p.is_dir()]
    except FileNotFoundError:
        return None
    return relay_progress.read_record_at(lives[0]) if lives else None


def _trace_lines(path: Path) -> list[str]:
    return [ln.split()[1] for ln in path.read_text().splitlines()] if path.exists() else []


def _traced(path: Path) -> list[str]:
    """The tensors the reader had, in order (its ``@`` lines say where it is, not what it has)."""
    return [name for name in _trace_lines(path) if not name.startswith("@")]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "control-waits-for-the-whole-copy"])
@pytest.mark.parametrize("shape", ["sharded", "single"])
def test_a_follower_holds_tensors_while_the_copy_is_still_incomplete(s3, checkpoints, relay_dir, tmp_path,
                                                                      pipelined, shape):
    model = checkpoints[shape]
    # Slow until the follower is seen (12 MiB at 0.5 MiB/s would take 24 s), then at full speed:
    # the copy is still incomplete when the follower arrives however slow this machine is.
    with CountingProxy(s3.port, rate=MIB // 2) as link:
        leader = start_reader(s3, link.endpoint, model, relay_dir, range=MIB // 2, pipelined=pipelined)
        deadline = time.monotonic() + 120
        while _live_record(relay_dir) is None:
            assert time.monotonic() < deadline and leader.poll() is None, leader.communicate()
            time.sleep(0.02)
        trace = tmp_path / "follower.trace"
        follower = start_reader(s3, link.endpoint, model, relay_dir, pipelined=pipelined, trace=str(trace))
        held_while_incomplete: list[str] = []
        copied_then = None  # how much of the copy was on the node when the follower had its first tensor
        whole = False  # the copy has been whole (its marker seen) at some point
        at_door = None  # when the follower reached the relay
        while follower.poll() is None and time.monotonic() < deadline:
            record = _live_record(relay_dir)
            lines = _trace_lines(trace)
            got = [name for name in lines if not name.startswith("@")]
            whole = whole or _marker_exists(relay_dir)
            if got and not whole:
                held_while_incomplete = got  # the follower has these, and the copy is not whole yet
                if copied_then is None and record is not None:
                    copied_then = record["bytes"] / record["total"]
            if at_door is None and "@acquire" in lines:
                at_door = time.monotonic()
            # full speed once the follower has a tensor (pipelined) or has waited 2 s at the door (control)
            if link.bucket.rate and (got or (not pipelined and at_door and time.monotonic() - at_door > 2)):
                link.set_rate(None)
            time.sleep(0.02)
        results = [finish(leader), finish(follower)]
        weights = link.body_bytes(".safetensors")
    assert all(r["tensors"] == model["tensors"] for r in results)
    assert [r["fetched"] for r in results] == [True, False]
    assert model["bytes"] <= weights <= 1.05 * model["bytes"], weights / model["bytes"]
    if pipelined:
        assert results[1]["live"] and held_while_incomplete, "the follower got nothing before the copy was whole"
        assert copied_then is not None and copied_then < 0.75, copied_then  # loading long before the copy ends
    else:
        assert held_while_incomplete == []  # the control: not one tensor before the whole copy is there
    assert not any(relay_dir.rglob("*.safetensors")), [str(p) for p in relay_dir.rglob("*")]  # the last reader freed the copy


def test_a_stalled_object_holds_back_only_its_own_tensors(s3, checkpoints, relay_dir, tmp_path):
    """A shard whose reply stalls holds the copy back; the followers already hold every tensor
    of the other shard, and get the stalled shard's once it lands, never a torn byte."""
    model = checkpoints["sharded"]
    with CountingProxy(s3.port) as proxy:
        proxy.stall("00002-of-00002.safetensors", 3.5, times=2)  # pyarrow gives up at 3 s and asks again
        trace = tmp_path / "follower.trace"
        leader = start_reader(s3, proxy.endpoint, model, relay_dir, range=MIB, pipelined=True)
        deadline = time.monotonic() + 60
        while _live_record(relay_dir) is None:
            assert time.monotonic() < deadline and leader.poll() is None, leader.communicate()
            time.sleep(0.02)
        follower = start_reader(s3, proxy.endpoint, model, relay_dir, pipelined=True, trace=str(trace))
        first_shard = {"t0", "t1", "t2"}
        spans = _tensor_spans(model)
        while not first_shard <= set(_traced(trace)):
            assert time.monotonic() < deadline and follower.poll() is None, follower.communicate()
            held = set(_traced(trace))
            record = _live_record(relay_dir)
            if record is not None:  # read after the trace: a tensor held is a tensor whose bytes were verified
                assert held <= _covered(spans, record), (held, record["done"])
            time.sleep(0.02)
        record = _live_record(relay_dir)
        assert record is not None and record["state"] == relay_progress.COPYING  # still held back by the stall
        assert not _marker_exists(relay_dir)
        assert set(_traced(trace)) < set(model["tensors"])  # the stalled range's tensors are not had yet
        results = [finish(leader), finish(follower)]
    assert all(r["tensors"] == model["tensors"] for r in results)


def _tensor_spans(model: dict) -> dict[str, tuple[str, int, int]]:
    """Each tensor's (file, first byte, end) in the checkpoint, from the files' own headers."""
    import struct

    out = {}
    for name in model["weights"]:
        raw = (model["local"] / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for k, meta in json.loads(raw[8:8 + n]).items():
            if k != "__metadata__":
                b, e = meta["data_offsets"]
                out[k] = (name, 8 + n + b, 8 + n + e)
    return out


def _covered(spans: dict, record: dict) -> set[str]:
    done = record.get("done") or {}
    return {k for k, (f, b, e) in spans.items() if relay_progress.covers(done.get(f, []), b, e)}


def test_a_leader_killed_mid_copy_costs_only_what_was_not_yet_verified(s3, checkpoints, relay_dir):
    """Followers reading as the copy lands outlive the process copying it: one of them resumes
    the copy from its verified ranges, every follower finishes, the node reads about S.
    (The control, a copy made again from the start, is test_relay.py's ``control-restarted``.)"""
    model = checkpoints["single"]
    with CountingProxy(s3.port, rate=2 * MIB) as link:
        leader = start_reader(s3, link.endpoint, model, relay_dir, range=MIB // 4, pipelined=True)
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and leader.poll() is None, leader.communicate()
            record = _live_record(relay_dir)
            if record is not None:
                break
            time.sleep(0.02)
        followers = [start_reader(s3, link.endpoint, model, relay_dir, pipelined=True) for _ in range(2)]
        while (record := _live_record(relay_dir)) is None or record["bytes"] < 0.45 * model["bytes"]:
            assert time.monotonic() < deadline and leader.poll() is None
            time.sleep(0.05)
        leader.send_signal(signal.SIGKILL)
        leader.communicate()
        link.bucket.rate = None
        results = [finish(p) for p in followers]
        weights = link.body_bytes(".safetensors")
    assert all(r["tensors"] == model["tensors"] for r in results)
    resumed = [r for r in results if "resuming its copy here" in r["stderr"]]
    assert len(resumed) == 1, [r["stderr"][-2000:] for r in results]
    assert weights <= 1.3 * model["bytes"], weights / model["bytes"]
    assert not any(relay_dir.rglob("*.safetensors"))


def test_tensors_a_reader_holds_outlive_a_failed_copy_and_writes_stay_its_own(s3, checkpoints, relay_dir,
                                                                             monkeypatch):
    """A reader's tensors are private mappings of the copy's pages: a write to one never reaches
    the node's copy, and a copy that fails under the reader (its files go) leaves what the reader
    holds whole. Control: the truncation a failed copy used to do kills a reader touching such a
    tensor with SIGBUS."""
    model = checkpoints["sharded"]
    spans = _tensor_spans(model)
    monkeypatch.setattr(relay_copy, "RANGE_BYTES", MIB)
    monkeypatch.setattr(relay_copy, "RANGE_TRIES", 1)  # the stalled shard fails the copy at once
    held: dict = {}
    with CountingProxy(s3.port) as proxy:
        proxy.stall("00002-of-00002.safetensors", 3.5, times=4)  # past pyarrow's 3 s request timeout
        got = relay.acquire(model["uri"], lambda uri: (endpoint_s3_filesystem(False, proxy.endpoint),
                                                       uri.split("://", 1)[1]), pipelined=True)
        assert got is not None and got.live
        live = relay_read.open_live(got.path)
        copy = got.path.parent / relay_copy.live_name(got.path.name) / "model-00001-of-00002.safetensors"
        try:
            with pytest.raises(relay_read.Unavailable, match="the copy failed"):
                for name, tensor in live.tensors():
                    held[name] = tensor
                    if name == "t0":
                        _, b, e = spans["t0"]
                        before = copy.read_bytes()[b:e]
                        tensor.fill_(0)  # the reader's own pages now
                        assert copy.read_bytes()[b:e] == before  # the node's copy is untouched
            got.wait()
        finally:
            relay.release(got)
    assert set(held) == {"t0", "t1", "t2"}  # the first shard's; the stalled one's never came
    assert not any(relay_dir.rglob("*.safetensors"))  # the failed copy's files are gone ...
    assert {k: digest(held[k]) for k in ("t1", "t2")} == {k: model["tensors"][k] for k in ("t1", "t2")}  # ... yet
    assert not held["t0"].any()  # what the reader wrote stays its own

    # Control: a mapped tensor whose file is truncated under it, as failed copies once were.
    probe = (
        "import os, sys, tempfile, torch\n"
        "from ray_runai_shim.snapshot import relay_read as r\n"
        "fd, path = tempfile.mkstemp(dir='/dev/shm'); os.unlink(path)\n"
        "os.write(fd, bytes(1 << 20))\n"
        "t = r._tensor(r._File('f', 1 << 20, fd=fd), r._Tensor('x', 'float32', (1 << 18,), 0, 1 << 20))\n"
        "os.ftruncate(fd, 0)\n"
        "print(float(t.sum()))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env=base_env({}))
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])


def _store_iterator(s3, model: dict):
    """vLLM's own iterator, as the rank falls back to it: the real streamer on the store."""

    def iterate(path: str, *_rest):
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"{path}/{k}" for k in model["weights"]])
            for name, tensor in streamer.get_tensors():
                yield name, tensor.clone()

    return iterate


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "control-unpinned"])
def test_an_object_overwritten_mid_copy_never_gives_a_reader_two_versions(s3, tmp_path, relay_dir, monkeypatch,
                                                                          caplog, pinned):
    import torch
    from safetensors.torch import save_file

    shard = "model.safetensors"
    model = upload_model(s3, tmp_path, f"pipe/torn-{pinned}", {shard: {f"t{i}": (512, 512) for i in range(6)}}, 5)
    new = {f"t{i}": torch.randn(512, 512, generator=torch.Generator().manual_seed(99 + i)) for i in range(6)}
    save_file(new, str(tmp_path / "new.safetensors"))
    new_digests = {k: digest(t) for k, t in new.items()}
    assert (tmp_path / "new.safetensors").stat().st_size == (tmp_path / shard).stat().st_size
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # the fallback streams straight from the store
    monkeypatch.setattr(relay_copy, "RANGE_BYTES", MIB)
    monkeypatch.setattr(relay_copy, "WORKERS", 1)  # one range after another: the overwrite lands between them
    monkeypatch.setattr(relay_copy, "PIN_VERSIONS", pinned)
    base = relay.root()
    with CountingProxy(s3.port) as proxy:
        proxy.stall(shard, 2.0)  # the first range's reply pauses; the store's object changes meanwhile

        t = overwrite.when_copying(base, lambda: s3.client().upload_file(
            str(tmp_path / "new.safetensors"), BUCKET, f"{model['prefix']}/{shard}"))
        try:
            with caplog.at_level(logging.WARNING, logger="ray_runai_shim"):
                got = relay.acquire(model["uri"], lambda uri: (endpoint_s3_filesystem(False, proxy.endpoint),
                                                               uri.split("://", 1)[1]), pipelined=True)
                assert got is not None and got.live
                live = relay_read.open_live(got.path)
                seen = {name: digest(tensor) for name, tensor in
                        as_it_lands(live, _store_iterator(s3, model), (str(got.path), None), {})}
                got.wait()
        finally:
            t.join()
            relay.release(got)
    olds = {k for k, v in seen.items() if v == model["tensors"][k]}
    news = {k for k, v in seen.items() if v == new_digests[k]}
    assert set(seen) == set(new)
    if pinned:
        assert news == set(new)  # the rank streamed every tensor again, of the version now stored: one version
        said = [r.getMessage() for r in caplog.records if "this rank streams" in r.getMessage()]
        assert len(said) == 1 and f"{shard} changed while the node relay copied it" in said[0], said
    else:  # the control: without the pin the reader's model is of no one version (mixed, or a tensor torn)
        assert olds != set(new) and news != set(new), (olds, news)
    assert not any(relay_dir.rglob("*.safetensors"))


def test_a_long_copy_says_how_far_it_is_and_a_short_one_says_nothing(s3, checkpoints, relay_dir, monkeypatch,
                                                                       caplog):
    model = checkpoints["single"]
    fs_and_path = None
    with CountingProxy(s3.port, rate=4 * MIB) as link:
        def fs_and_path(uri):
            return endpoint_s3_filesystem(False, link.endpoint), uri.split("://", 1)[1]

        monkeypatch.setattr(relay_progress, "LOG_EVERY_S", 1.0)  # a 3 s copy, told every second
        monkeypatch.setattr(relay_copy, "RANGE_BYTES", MIB // 2)
        with caplog.at_level(logging.INFO, logger="ray.runai_shim"):
            got = relay.acquire(model["uri"], fs_and_path, pipelined=True)
            got.wait()
        relay.release(got)
    told = [r.getMessage() for r in caplog.records if "node relay: copying s3://" in r.getMessage()]
    # each line: how far (in the unit that fits: the first may still be KiB), of the whole, rate, time left
    assert len(told) >= 2 and all(" of 12.0 MiB (" in m and "/s, about" in m and "left" in m for m in told), told
    [figures] = [f for f in relay_progress.current() if f["uri"] == model["uri"]]
    assert figures["state"] == relay_progress.DONE and figures["bytes"] == figures["total"] == model["bytes"]
    assert figures["rate_bytes_s"] > 0 and figures["eta_s"] == 0
    import ray_runai_shim

    assert figures in ray_runai_shim.status()["relay_copy"]  # status() shows the same figures

    monkeypatch.setattr(relay_progress, "LOG_EVERY_S", 10.0)  # the default, on an unlimited link
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray.runai_shim"):
        got = relay.acquire(model["uri"], lambda uri: (endpoint_s3_filesystem(False, s3.endpoint),
                                                       uri.split("://", 1)[1]), pipelined=True)
        got.wait()
    relay.release(got)
    assert not [r for r in caplog.records if "node relay: copying s3://" in r.getMessage()]
