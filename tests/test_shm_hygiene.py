"""The suite's /dev/shm hygiene (support/shm.py): only our own, unused, new vLLM segments go."""

from __future__ import annotations

import subprocess
import sys

from support import shm


def test_only_new_unused_vllm_segments_are_removed():
    with shm.tmpdir("rrs-shm-test-") as root:
        (root / "psm_old").write_bytes(b"x")  # was there before: never ours
        before = shm.snapshot(root)
        for name in ("psm_new", "psm_busy", "rank0-cpushm_1", "not-vllm"):
            (root / name).write_bytes(b"x")
        holder = subprocess.Popen([sys.executable, "-c", f"import sys, mmap; f = open({str(root / 'psm_busy')!r}, 'r+b');"
                                   " m = mmap.mmap(f.fileno(), 0); sys.stdout.write('ready\\n'); sys.stdout.flush();"
                                   " sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            removed = shm.clean_new(before, root)
        finally:
            holder.communicate(timeout=30)
        assert removed == ["psm_new", "rank0-cpushm_1"]
        assert sorted(p.name for p in root.iterdir()) == ["not-vllm", "psm_busy", "psm_old"]


def test_the_end_of_run_sweep_waits_for_a_stopping_engines_last_process():
    with shm.tmpdir("rrs-shm-test-") as root:
        before = shm.snapshot(root)
        (root / "psm_stopping").write_bytes(b"x")
        holder = subprocess.Popen([sys.executable, "-c", f"import sys, time, mmap; f = open({str(root / 'psm_stopping')!r}, 'r+b');"
                                   " m = mmap.mmap(f.fileno(), 0); sys.stdout.write('ready\\n'); sys.stdout.flush();"
                                   " time.sleep(2)"], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            assert shm.clean_new(before, root) == []  # held: a module's sweep leaves it
            assert shm.clean_new(before, root, wait_s=30) == ["psm_stopping"]  # gone once its holder exits
        finally:
            holder.wait(timeout=30)
        assert list(root.iterdir()) == []
