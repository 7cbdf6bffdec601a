"""The benchmark's parts (bench/), without servers, children or big files: imports,
the pieces it shares with tests/support, and its pure functions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_download  # noqa: E402
import bench_measure  # noqa: E402
import bench_models  # noqa: E402
import bench_report  # noqa: E402
import bench_servers  # noqa: E402
from support import s3server, servers  # noqa: E402


def test_bench_shares_the_tests_port_picker_and_process_lifecycle():
    assert bench_servers.free_port is s3server.free_port is servers.free_port
    srv = bench_servers.S3rver(Path("/x/s3rver.js"), Path("/x/data"), Path("/x/log"))
    assert isinstance(srv, servers.ServerProcess) and not srv.running
    assert srv.endpoint == f"http://127.0.0.1:{srv.port}"
    cmd = srv.command()
    assert cmd[1:] == ["/x/s3rver.js", "-d", "/x/data", "-a", "127.0.0.1", "-p", str(srv.port),
                       "--no-vhost-buckets", "--allow-mismatched-signatures", "-s"]
    assert srv.env()["AWS_ENDPOINT_URL_S3"] == srv.endpoint
    srv.stop()  # never started: a no-op


def test_the_child_is_the_cli():
    assert bench_measure.CLI == BENCH / "bench_download.py" and bench_measure.CLI.is_file()
    assert bench_download.RESULTS_JSON == BENCH / "results" / "latest.json"


def test_parse_sizes():
    assert bench_download.parse_sizes("1,2, 4,") == [1.0, 2.0, 4.0]
    with pytest.raises(Exception, match="positive"):
        bench_download.parse_sizes("0")


def test_trend():
    assert bench_report._trend([1.0]) == "n/a (one size)"
    assert bench_report._trend([1.0, 1.1]).startswith("flat (x1.10")
    assert bench_report._trend([1.0, 2.0]).startswith("rises (x2.00")
    assert bench_report._trend([0.1, 0.2], abs_tol=0.25).startswith("flat within noise")


def _row(size, method, wall, rss, weight):
    return {"size_gib": size, "method": method, "wall_s": wall, "peak_rss_mib": rss,
            "rss_before_download_mib": 300.0, "weight_bytes": weight, "nonweight_bytes": 10,
            "expected_weight_bytes": 2 * bench_models.MIB, "child_log_errors": [],
            "fetched_files": 5, "fetched_bytes": 10, "listed_nonweight_bytes": 10}


def test_report_prints_the_tables_and_returns_the_summary(capsys):
    rows = [_row(1, "unpatched", 2.0, 400.0, 2 * bench_models.MIB), _row(1, "shim", 0.5, 320.0, 0)]
    imp = {"runs": 1, "median_ms": 20.0, "samples_ms": [20.0], "ray_in_sys_modules": False,
           "vllm_in_sys_modules": False, "wrapt_in_sys_modules": False, "pyarrow_in_sys_modules": False}
    summary = bench_report.report(rows, imp)
    out = capsys.readouterr().out
    assert summary["ratios"] == [{"size_gib": 1, "wall_ratio": 0.25, "rss_ratio": 0.8}]
    assert "unpatched wrote 2,097,152 of 2,097,152 weight bytes (complete)" in summary["checks"][0]
    assert "       1 | unpatched |    2.00 |" in out and "median of 1): 20.0 ms" in out
    assert set(bench_report.env_info()) >= {"python", "cpus", "s3rver", "ray"}


def test_build_model_writes_valid_shards_and_walk_bytes_splits_them(tmp_path):
    pytest.importorskip("safetensors")
    noise = bench_models.make_noise(bench_models.MIB)
    model = bench_models.build_model(tmp_path / "m", 2 * bench_models.MIB, noise)
    assert model["shards"] == 1 and model["weight_bytes"] > 2 * bench_models.MIB
    header_len = int.from_bytes((tmp_path / "m" / "model.safetensors").read_bytes()[:8], "little")
    assert json.loads((tmp_path / "m" / "model.safetensors").read_bytes()[8:8 + header_len])
    disk = bench_measure.walk_bytes([tmp_path])
    assert disk["weight_bytes"] == model["weight_bytes"] and disk["weight_files"] == ["m/model.safetensors"]
    assert disk["nonweight_bytes"] == model["nonweight_bytes"]
