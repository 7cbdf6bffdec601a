"""How much memory a node can still give, and the streamer budget under a real memory limit.

The last two tests run four reader processes (the node relay, then the real Run:ai streamer,
``support/relaychild.py``) inside a memory cgroup this test creates, with a limit that four
readers at the streamer's default (it buffers the whole checkpoint, up to 40 GB, per reader)
exceed: the control is killed by the kernel; with the shim's budget the peak stays under the
limit and every reader gets every tensor; with a limit too small for the relay's copy they
stream from the store one tensor at a time and say so.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.fixtures import BUCKET
from support.procs import base_env
from support.relaychild import CHILD

from ray_runai_shim.snapshot import memory, relay

MIB = 1 << 20
TENSOR = 128 * MIB


def upload_model(s3, d: Path, prefix: str, shards: list[int]) -> dict:
    """A safetensors checkpoint of 128 MiB tensors (``shards[i]`` in shard i, each tensor a
    different fill) in the bucket under *prefix*; only the store keeps the weights."""
    import torch
    from safetensors.torch import save_file

    want, names = {}, []
    for shard, count in enumerate(shards):
        tensors = {f"w{shard}.{i}": torch.full((TENSOR // 4,), float(shard * 100 + i)) for i in range(count)}
        for k, t in tensors.items():
            want[k] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        name = f"model-{shard + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(d / name))
        names.append(name)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    client = s3.client()
    for p in d.iterdir():
        client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")
    size = sum((d / n).stat().st_size for n in names)
    for n in names:
        (d / n).unlink()
    return {"uri": f"s3://{BUCKET}/{prefix}", "weights": names, "bytes": size, "tensors": want}


@pytest.fixture(scope="module")
def model768(s3, models, tmp_path_factory):
    """768 MiB: two shards of three 128 MiB tensors."""
    return upload_model(s3, tmp_path_factory.mktemp("mem768"), "mem/m768", [3, 3])


@pytest.fixture(scope="module")
def model256(s3, models, tmp_path_factory):
    """256 MiB: one shard of two 128 MiB tensors."""
    return upload_model(s3, tmp_path_factory.mktemp("mem256"), "mem/m256", [2])


class MemCgroup:
    """A v1 or v2 memory cgroup under this process's own, with a hard limit; processes are
    started in it, its peak and OOM kills read back, removed at the end."""

    def __init__(self, limit: int):
        v2 = memory.CGROUP / "cgroup.controllers"
        v2_rel, v1_rel = memory._own_paths()
        name = f"rrs-test-{os.getpid()}-{os.urandom(3).hex()}"
        if v2.exists():
            self.dir, self.limit_file, self.peak_file = memory.CGROUP / v2_rel / name, "memory.max", "memory.peak"
        else:
            self.dir = memory.CGROUP / "memory" / v1_rel / name
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        try:
            self.dir.mkdir()
            (self.dir / self.limit_file).write_text(str(limit))
        except OSError as e:
            if self.dir.exists():
                self.dir.rmdir()
            pytest.skip(f"no memory cgroup can be created here ({e}); the budget needs a container-style limit")
        self.limit = limit

    def popen(self, cmd: list[str], env: dict) -> subprocess.Popen:
        procs = str(self.dir / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=join)

    def peak(self) -> int:
        return int((self.dir / self.peak_file).read_text())

    def oom_kills(self) -> int:
        for name in ("memory.oom_control", "memory.events"):
            path = self.dir / name
            if path.exists():
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def remove(self) -> None:
        if self.dir.exists():
            self.dir.rmdir()


def run_readers(s3, model: dict, relay_dir: Path, limit: int, readers: int, budget: bool) -> tuple[list[dict], int, int]:
    """*readers* reader processes in a fresh cgroup of *limit* bytes: their results, the
    cgroup's peak and its OOM kills."""
    cg = MemCgroup(limit)
    try:
        results = _readers(s3, model, relay_dir, cg, readers, budget)
        return results, cg.peak(), cg.oom_kills()
    finally:
        cg.remove()


def _readers(s3, model: dict, relay_dir: Path, cg: MemCgroup, readers: int, budget: bool) -> list[dict]:
    env = base_env({**s3.env(), relay.RELAY_DIR: str(relay_dir)})
    env.pop("RUNAI_STREAMER_MEMORY_LIMIT", None)
    payload = {"uri": model["uri"], "endpoint": s3.endpoint, "weights": model["weights"], "mode": "relay",
               "hold": 0.5, **({"budget": readers} if budget else {})}
    procs = [cg.popen([sys.executable, str(CHILD), json.dumps(payload)], env) for _ in range(readers)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        results.append({"returncode": p.returncode, "stderr": err[-3000:],
                        **(json.loads(lines[-1]) if lines else {})})
    return results


@pytest.mark.slow
def test_four_readers_stay_under_a_container_limit_their_defaults_exceed(s3, model768, shm_relay_dir):
    s = model768["bytes"]
    limit = 3 * 1024 * MIB  # four default buffers alone are 4 x 0.75 GiB, and the copy adds 0.75 GiB
    results, peak, kills = run_readers(s3, model768, shm_relay_dir, limit, 4, budget=True)
    for r in results:
        assert r["returncode"] == 0 and r.get("tensors") == model768["tensors"], r
        assert r["relay"] and TENSOR <= int(r["memory_limit"]) < s, r  # a share: a tensor or more, less than S
    assert kills == 0 and peak < limit, (peak, limit)
    assert sorted(p.name for p in shm_relay_dir.iterdir()) == []  # the last reader freed the copy

    # Control: the same four readers at the streamer's default in the same limit.
    results, _, kills = run_readers(s3, model768, shm_relay_dir, limit, 4, budget=False)
    assert kills >= 1 and any(r["returncode"] != 0 for r in results), [r["returncode"] for r in results]


@pytest.mark.slow
def test_too_small_for_the_copy_streams_from_the_store_one_tensor_at_a_time(s3, model256, shm_relay_dir):
    """Two readers (the rule is the same for four; two keep the store traffic small)."""
    limit = 1280 * MIB  # no room for the 256 MiB copy on top of the 1 GiB headroom; a share below one tensor
    results, peak, kills = run_readers(s3, model256, shm_relay_dir, limit, 2, budget=True)
    for r in results:
        assert r["returncode"] == 0 and r.get("tensors") == model256["tensors"], r
        assert r["relay"] is None and r["memory_limit"] == str(memory.MINIMAL), r
        lines = [ln for ln in r["stderr"].splitlines() if "ray-runai-shim" in ln]
        assert any("node relay cannot hold" in ln and "streaming from the store instead" in ln for ln in lines), lines
        assert any("reads one tensor at a time" in ln for ln in lines), lines
    assert kills == 0 and peak < limit, (peak, limit)
    assert list(shm_relay_dir.iterdir()) == []


def test_room_reads_the_kernel():
    r = memory.room(Path("/dev/shm"))
    assert r.available and r.available > 0 and r.filesystem and r.filesystem > 0
    assert r.usable() <= min(v for v in (r.available, r.cgroup, r.filesystem) if v is not None)


def test_cgroup_limits_are_read_from_v2_and_v1_files(tmp_path):
    """The tightest limit on the way up from this process's own cgroup, in either version."""
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "kubepods" / "memory.max").write_text("8589934592\n")
    (v2 / "kubepods" / "memory.current").write_text("1073741824\n")
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup-v2"
    proc.write_text("0::/kubepods/pod1\n")
    assert memory.cgroup_room(v2, proc) == 7 << 30  # the parent's limit binds
    (v2 / "kubepods" / "pod1" / "memory.max").write_text(str(3 << 30))
    (v2 / "kubepods" / "pod1" / "memory.current").write_text(str(1 << 30))
    assert memory.cgroup_room(v2, proc) == 2 << 30  # and the pod's own, tighter one
    (v2 / "kubepods" / "memory.max").write_text("max\n")
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert memory.cgroup_room(v2, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "c1").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str((1 << 63) - 4096))  # v1's "no limit"
    (v1 / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (v1 / "memory" / "docker" / "c1" / "memory.usage_in_bytes").write_text(str(1 << 30))
    proc1 = tmp_path / "cgroup-v1"
    proc1.write_text("9:pids:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    assert memory.cgroup_room(v1, proc1) == 3 << 30
    (v1 / "memory" / "docker" / "c1" / "memory.limit_in_bytes").write_text(str((1 << 63) - 4096))
    assert memory.cgroup_room(v1, proc1) is None


def test_a_readers_budget_is_its_share_of_the_room():
    gib = 1 << 30
    assert memory.reader_budget(1, 200 * gib) is None  # the streamer's 40 GB default fits
    assert memory.reader_budget(4, 20 * gib, total=4 * gib) is None  # the default buffers the whole 4 GiB: fits
    assert memory.reader_budget(4, 20 * gib) == 5 * gib
    assert memory.reader_budget(4, 20 * gib, largest=512 << 20, total=60 * gib) == 5 * gib
    assert memory.reader_budget(8, 4 * gib, largest=1 * gib) == memory.MINIMAL  # a share below the largest tensor
    assert memory.reader_budget(8, 4 * gib, largest=256 << 20) == gib // 2
    assert memory.reader_budget(8, 4 * gib) == memory.MINIMAL  # largest unknown: 2 GiB assumed


def test_a_reader_of_the_local_copy_gets_a_small_buffer_capped_by_its_share():
    mib, gib = 1 << 20, 1 << 30
    cap = memory.LOCAL_READ_BYTES
    assert cap == 256 * mib
    assert memory.local_read_limit(None, 64 * mib, gib) == cap  # the default would buffer the whole 1 GiB
    assert memory.local_read_limit(None, 512 * mib, 2 * gib) == 512 * mib  # never below the largest tensor
    assert memory.local_read_limit(128 * mib, 64 * mib, gib) == 128 * mib  # a tighter share stays
    assert memory.local_read_limit(2 * gib, 64 * mib, 4 * gib) == cap
    assert memory.local_read_limit(memory.MINIMAL, 64 * mib, gib) == memory.MINIMAL
    assert memory.local_read_limit(None, 64 * mib, 200 * mib) is None  # a checkpoint under the cap: no setting


def test_set_budget_on_a_relay_copy_sets_the_small_buffer_and_on_a_lone_reader_nothing(tmp_path, monkeypatch):
    """A sparse 768 MiB local checkpoint of 128 MiB tensors (headers real, data holes)."""
    import struct

    from ray_runai_shim.integrations import relay_budget as relay_integration

    n = TENSOR // 4
    header = {f"w{i}": {"dtype": "F32", "shape": [n], "data_offsets": [i * TENSOR, (i + 1) * TENSOR]} for i in range(6)}
    blob = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + 6 * TENSOR)
    # set_budget writes os.environ itself: setenv first so that monkeypatch restores the variable
    # (delenv of an absent one records nothing, and the limit leaked into later tests' processes)
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", "")
    monkeypatch.delenv("RUNAI_STREAMER_MEMORY_LIMIT")
    assert relay_integration.set_budget(1, str(tmp_path)) is None and "RUNAI_STREAMER_MEMORY_LIMIT" not in os.environ
    usable = memory.room(Path("/dev/shm")).usable()
    want = memory.local_read_limit(memory.reader_budget(2, usable, largest=TENSOR, total=6 * TENSOR), TENSOR,
                                   6 * TENSOR)
    assert relay_integration.set_budget(2, str(tmp_path)) == want <= memory.LOCAL_READ_BYTES
    assert os.environ["RUNAI_STREAMER_MEMORY_LIMIT"] == str(want)
