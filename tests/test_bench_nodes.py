"""The nodes benchmark's pure parts (bench/bench_nodes.py), without servers or readers: arguments,
the plan, the goal ratios, the tables, the docs block, the memory sampler, the copy lock."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_docs  # noqa: E402
import bench_nodes as bn  # noqa: E402

S = 100 * bn.MIB


def _row(n, method, wall, rate=40.0, store_x=1.0, **extra):
    return {"rate_mbps": rate, "n": n, "method": method, "wall_s": wall, "store_x": store_x,
            "store_bytes": int(store_x * S), "peak_mem_bytes": 300 * bn.MIB, "own_mem_bytes": 200 * bn.MIB,
            "disk_bytes": S if method == "ray-copy" else 0, **extra}


def _rows(rate=40.0):
    return [_row(1, "stream", 10.0, rate), _row(1, "auto", 10.2, rate, auto_relays=False),
            _row(1, "relay", 11.0, rate), _row(1, "ray-copy", 12.0, rate),
            _row(2, "stream", 20.0, rate, store_x=2.0), _row(2, "relay", 10.0, rate), _row(2, "ray-copy", 12.5, rate),
            _row(4, "stream", 40.0, rate, store_x=4.0), _row(4, "relay", 14.0, rate), _row(4, "ray-copy", 14.0, rate)]


def test_arguments():
    assert bn.parse_ns("1,2, 4,") == [1, 2, 4]
    assert bn.parse_rates("40,0") == [40.0, 0.0]
    assert bn.parse_methods("relay, stream") == ["relay", "stream"]
    for parse, bad in ((bn.parse_ns, "0"), (bn.parse_ns, "x"), (bn.parse_rates, "-1"), (bn.parse_methods, "copy")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_the_plan_runs_auto_at_one_reader_only_and_the_budget_at_two_or_more():
    assert bn.plan([1, 2], list(bn.METHODS)) == [
        (1, "stream"), (1, "auto"), (1, "relay"), (1, "relay-wait"), (1, "ray-copy"),
        (2, "stream"), (2, "relay"), (2, "relay-wait"), (2, "relay-budget"), (2, "ray-copy")]
    assert bn.child_env({}, {}, "http://127.0.0.1:1", Path("/dev/shm/x"), "relay-wait", 2, None)[
        "RAY_RUNAI_SHIM_RELAY"] == "on"
    assert bn.plan([4], ["auto", "stream"]) == [(4, "stream")]
    env = bn.child_env({}, {}, "http://127.0.0.1:1", Path("/dev/shm/x"), "relay-budget", 4, None, budget_mib=128)
    assert env["RUNAI_STREAMER_MEMORY_LIMIT"] == str(128 << 20) and env["RAY_RUNAI_SHIM_RELAY"] == "on"
    assert "RUNAI_STREAMER_MEMORY_LIMIT" not in bn.child_env({}, {}, "http://127.0.0.1:1", Path("/dev/shm/x"),
                                                              "relay", 4, None)


def test_every_wait_is_bounded_by_the_link():
    assert bn.run_timeout(4, 10**9, 40.0) == pytest.approx(300 + 4 * 4 * 10**9 / 40e6)
    assert bn.run_timeout(1, 10**9, 0.0) == pytest.approx(300 + 4 * 10**9 / 50e6)  # unlimited: 50 MB/s assumed


def test_ratios_and_goals_on_a_limited_link():
    got = {(r["name"], r["n"]): r for r in bn.ratios(_rows(), 40.0)}
    assert got[("relay/ray-copy", 2)]["value"] == pytest.approx(0.8) and got[("relay/ray-copy", 2)]["met"] is True
    assert got[("relay/ray-copy", 4)]["value"] == pytest.approx(1.0) and got[("relay/ray-copy", 4)]["met"] is False
    assert got[("relay/stream", 2)]["value"] == pytest.approx(0.5) and got[("relay/stream", 2)]["met"] is True
    assert got[("relay/stream", 4)]["value"] == pytest.approx(0.35) and got[("relay/stream", 4)]["met"] is False
    assert got[("auto/stream", 1)]["value"] == pytest.approx(1.02) and got[("auto/stream", 1)]["met"] is True
    # #36: against ONE reader streaming (the physical limit), within 5 % on a limited link
    assert got[("relay/stream (N=1)", 2)]["value"] == pytest.approx(1.0) and got[("relay/stream (N=1)", 2)]["met"]
    assert got[("relay/stream (N=1)", 4)]["value"] == pytest.approx(1.4)
    assert got[("relay/stream (N=1)", 4)]["met"] is False


def test_a_followers_first_tensor_is_judged_against_the_copys_duration():
    rows = _rows()
    rows[5] = _row(2, "relay", 10.0, follower_first_s=0.5, copy_s=10.0)
    rows[8] = _row(4, "relay", 14.0, follower_first_s=3.0, copy_s=10.0)
    got = {(r["name"], r["n"]): r for r in bn.ratios(rows, 40.0)}
    first = "follower's first tensor / copy"
    assert got[(first, 2)]["value"] == pytest.approx(0.05) and got[(first, 2)]["met"] is True
    assert got[(first, 4)]["value"] == pytest.approx(0.3) and got[(first, 4)]["met"] is False
    assert "| 2 | relay | 10.00 s | 0.50 s | 1.00 x S |" in bn.table_for(rows, 40.0)


def test_on_an_unlimited_link_only_the_n1_goal_is_judged():
    got = {(r["name"], r["n"]): r for r in bn.ratios(_rows(0.0), 0.0)}
    assert got[("relay/stream", 4)]["value"] == pytest.approx(0.35)
    assert got[("relay/stream", 4)]["met"] is None and not got[("relay/stream", 4)]["applies"]
    assert got[("auto/stream", 1)]["met"] is True
    # #36's goals for an unlimited link are judged there (and listed only there)
    assert got[("relay/stream (N=1)", 2)]["goal"] == "<= 1.2" and got[("relay/stream (N=1)", 2)]["met"] is True
    assert got[("relay/stream (N=1)", 4)]["goal"] == "<= 1.5" and got[("relay/stream (N=1)", 4)]["met"] is True
    limited = [r for r in bn.ratios(_rows(), 40.0) if r["name"] == "relay/stream (N=1)"]
    assert {r["goal"] for r in limited} == {"<= 1.05"}


def test_a_failed_or_missing_side_has_no_ratio_and_an_unrun_n_no_line():
    rows = [r for r in _rows() if r["n"] != 4]
    rows[4] = {"rate_mbps": 40.0, "n": 2, "method": "stream", "error": "RuntimeError: reader 0: File access error"}
    got = {(r["name"], r["n"]): r for r in bn.ratios(rows, 40.0)}
    assert ("relay/stream", 4) not in got
    assert got[("relay/stream", 2)]["value"] is None and got[("relay/stream", 2)]["met"] is None
    assert bn.ratio(1.0, 0.0) is None and bn.ratio(None, 2.0) is None


def test_the_table_of_one_link():
    rows = _rows()
    rows.append({"rate_mbps": 40.0, "n": 8, "method": "stream", "error": "TimeoutError: readers not done\nlog tail"})
    text = bn.table_for(rows, 40.0)
    assert text.startswith("Link to the store: **40 MB/s**")
    assert "| 1 | auto (streams) | 10.20 s | - | 1.00 x S | 300 MiB | 200 MiB | 0 |" in text
    assert "| 2 | ray-copy | 12.50 s | - | 1.00 x S | 300 MiB | 200 MiB | 100 MiB |" in text
    assert "| 4 | stream | 40.00 s | - | 4.00 x S |" in text
    assert "| 8 | stream | failed: TimeoutError: readers not done | - | - | - | - | - |" in text
    assert "| relay/stream | 4 | 0.35 | <= 0.3 | **no** |" in text
    assert "| auto/stream | 1 | 1.02 | within 3 % | yes |" in text
    assert "(<= 0.9 on a limited link) | - |" in bn.table_for(_rows(0.0), 0.0)


def _data(rows):
    return {"when": "2026-12-05T21:00:00+0000", "env": {"cpus": 2, "platform": "Linux-x"},
            "model": {"weight_bytes": bn.GIB, "shards": 1}, "request_timeout_ms": 30000,
            "streamer_env": {"RUNAI_STREAMER_CONCURRENCY": "4"}, "runs": rows}


def test_tables_per_link_in_run_order_with_the_legend():
    text = bn.tables(_data(_rows(40.0) + _rows(0.0)))
    assert text.index("**40 MB/s**") < text.index("**unlimited")
    assert "- `ray-copy`: Ray alone" in text and "- `auto`: shim default" in text


def test_the_docs_block_is_rewritten_between_its_markers(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{bn.BEGIN}\nNot run yet\n{bn.END}\n\nafter\n")
    assert bench_docs.page(tmp_path, bn.PAGE) == doc and bench_docs.page(doc, bn.PAGE) == doc
    assert bench_docs.has_block(doc, bn.BEGIN, bn.END)
    block = bn.readme_block(_data(_rows()))
    assert block.startswith(bn.BEGIN + "\nGenerated by `./dev bench nodes` on 2026-12-05T21:00:00+0000 (2 CPUs")
    assert "1.00 GiB synthetic safetensors checkpoint" in block and block.endswith(bn.END)
    assert "`RUNAI_STREAMER_CONCURRENCY=4`, `RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS=30000`" in block
    bench_docs.write_block(doc, bn.BEGIN, bn.END, block)
    text = doc.read_text()
    assert text.startswith("# B\n\nbefore\n\n" + bn.BEGIN) and text.endswith(bn.END + "\n\nafter\n")
    assert "Not run yet" not in text and text.count(bn.BEGIN) == 1
    (tmp_path / "other.md").write_text("no markers")
    assert not bench_docs.has_block(tmp_path / "other.md", bn.BEGIN, bn.END)
    assert not bench_docs.has_block(tmp_path / "missing.md", bn.BEGIN, bn.END)
    with pytest.raises(SystemExit, match="needs exactly one"):
        bench_docs.write_block(tmp_path / "other.md", bn.BEGIN, bn.END, block)


def test_the_repo_page_has_the_block():
    assert bench_docs.has_block(bench_docs.page(BENCH.parent / "docs", bn.PAGE), bn.BEGIN, bn.END)


def test_mem_available_and_the_sampler(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemAvailable:   512 kB\n")
    assert bn.mem_available(meminfo) == 512 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError):
        bn.mem_available(meminfo)
    shm = tmp_path / "copy"
    shm.mkdir()
    sampler = bn.MemSampler((os.getpid(),), shm, interval=0.01).start()
    (shm / "w").write_bytes(b"x" * 4096)
    time.sleep(0.05)
    assert sampler.stop() >= 0 and sampler.stop() >= 0  # idempotent
    assert sampler.own_peak >= 4096
    assert bn.rss_bytes(os.getpid()) > 0 and bn.rss_bytes(2**22 + 12345) == 0
    assert bn.dir_bytes(tmp_path) == meminfo.stat().st_size + 4096


def test_a_readers_environment():
    base = {"PATH": "/bin", "RAY_RUNAI_SHIM_RELAY": "off", "RAY_RUNAI_SHIM_DISABLE": "1",
            "RUNAI_STREAMER_CONCURRENCY": "4", "PYTHONPATH": "/x"}
    env = bn.child_env(base, {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_ENDPOINT_URL": "http://store"},
                       "http://127.0.0.1:9", Path("/dev/shm/d"), "relay", 2, 30000)
    assert "RAY_RUNAI_SHIM_DISABLE" not in env and env["RUNAI_STREAMER_CONCURRENCY"] == "4"
    assert env["AWS_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9"
    assert env["RAY_RUNAI_SHIM_RELAY"] == "on" and env["RAY_RUNAI_SHIM_RELAY_DIR"] == "/dev/shm/d"
    assert env["RAY_RUNAI_SHIM_NODE_ENGINES"] == "2" and env[bn.REQUEST_TIMEOUT_ENV] == "30000"
    assert env["PYTHONPATH"] == os.pathsep.join((str(bn.REPO_ROOT), "/x"))
    for method, mode in (("auto", "auto"), ("stream", "off"), ("ray-copy", "off")):
        env = bn.child_env(base, {}, "http://e", Path("/d"), method, 1, None)
        assert env["RAY_RUNAI_SHIM_RELAY"] == mode and bn.REQUEST_TIMEOUT_ENV not in env


def test_the_copy_lock_is_had_once_and_waited_for_with_a_deadline(tmp_path):
    lock = tmp_path / "model.lock"
    fd, first = bn._flock(lock, time.monotonic() + 1)
    try:
        assert first
        with pytest.raises(TimeoutError):
            bn._flock(lock, time.monotonic() + 0.2)  # flock: another open file description waits
    finally:
        os.close(fd)
    fd, first = bn._flock(lock, time.monotonic() + 1)
    os.close(fd)
    assert first
