"""The benchmark's parts (bench/), without servers, children or big files: imports,
the pieces it shares with tests/support, and its pure functions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_docs  # noqa: E402
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


def test_bench_docs_rewrites_only_its_own_block(tmp_path):
    begin, end = "<!-- b:begin -->", "<!-- b:end -->"
    doc = tmp_path / "page.md"
    other = "<!-- other:begin -->\nkept\n<!-- other:end -->"
    doc.write_text(f"head\n{begin}\nold\n{end}\n{other}\ntail\n")
    assert bench_docs.page(tmp_path, "page.md") == doc and bench_docs.page(doc, "unused.md") == doc
    assert bench_docs.has_block(doc, begin, end)
    assert not bench_docs.has_block(tmp_path / "missing.md", begin, end)
    bench_docs.write_block(doc, begin, end, f"{begin}\nnew\n{end}")
    assert doc.read_text() == f"head\n{begin}\nnew\n{end}\n{other}\ntail\n"
    doc.write_text(f"{begin}\n{end}\n{begin}\n{end}\n")  # twice: not rewritten
    assert not bench_docs.has_block(doc, begin, end)
    with pytest.raises(SystemExit, match=f"page.md needs exactly one {begin} ... {end} block to rewrite"):
        bench_docs.write_block(doc, begin, end, "x")
    assert doc.read_text() == f"{begin}\n{end}\n{begin}\n{end}\n"


# --- the cold-start benchmark (bench_coldstart*.py, bench_engine.py, rrs_timing) ---------------

import bench_coldstart  # noqa: E402
import bench_coldstart_report  # noqa: E402


def _run(method: str, first: float, download: float, load: float, written: int, store: int) -> dict:
    result = {"method": method, "engines": 1, "ray": "2.48.0", "shim_loaded": method == "shim", "rows": 4,
              "t_build": 100.0, "t_first": 100.0 + first, "t_last": 101.0 + first, "sample": "x"}
    events = [
        {"event": "download", "start": 10.0, "end": 10.0 + download},
        {"event": "load", "start": 20.0, "end": 20.0 + load, "loader": "L", "peak_rss_kib": 2048,
         "ancestors": [{"pid": 2, "cmdline": "VLLM::EngineCore", "peak_rss_kib": 9999 * 1024},
                       {"pid": 1, "cmdline": "ray::_MapWorker.__init__", "peak_rss_kib": 1024 * 1024}]},
    ]
    return bench_coldstart.summarize_run(result, events, {"weight_bytes": written}, store)


def test_summarize_run_reads_the_driver_stamps_the_timers_and_the_actor_by_its_ray_name():
    r = _run("shim", 40.0, 0.1, 5.0, 0, 123)
    assert r["first_output_s"] == 40.0 and r["last_output_s"] == 41.0
    assert r["download_s"] == pytest.approx(0.1) and r["load_s"] == 5.0 and r["loader"] == ["L"]
    assert r["engine_peak_rss_mib"] == 2.0
    assert r["actor_peak_rss_mib"] == 1024.0  # the ray:: ancestor, not the EngineCore in between
    assert r["weight_bytes_written"] == 0 and r["store_bytes"] == 123


def test_medians_ratios_and_the_readme_block(tmp_path, capsys):
    runs = [_run("ray-alone", 44.0, 4.0, 3.0, 1000, 1000), _run("ray-alone", 46.0, 4.0, 3.0, 1000, 1000),
            _run("shim", 45.0, 0.1, 5.0, 0, 1000), _run("shim", 45.0, 0.1, 5.0, 0, 1000),
            _run("native", 50.0, 0.2, 5.0, 0, 1000)]
    data = {"runs": runs, "multi": [], "settings": [
        {"settings": {}, "seconds": 2.0, "peak_rss_mib": 500.0},
        {"settings": {"RUNAI_STREAMER_CONCURRENCY": "4"}, "seconds": 3.0, "peak_rss_mib": 400.0}]}
    summary = bench_coldstart_report.report(data)
    med = summary["medians"]
    assert med["ray-alone"]["first_output_s"] == 45.0 and med["ray-alone"]["runs"] == 2
    assert summary["ratios"]["shim/ray-alone"]["first_output_s"] == pytest.approx(1.0)
    assert summary["ratios"]["shim/native"]["first_output_s"] == pytest.approx(0.9)
    assert summary["ratios"]["shim/ray-alone"]["weight_bytes_written"] == 0
    out = capsys.readouterr().out
    assert "| time to first output | 45.00 s | 45.00 s | 50.00 s | 1.00 | 0.90 |" in out
    assert "| RUNAI_STREAMER_CONCURRENCY=4 | 3.00 s | 400 MiB |" in out
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{bench_coldstart_report.BEGIN}\nSTALE-TEXT\n{bench_coldstart_report.END}\nafter\n")
    data.update(summary, when="now", env={"cpus": 2, "platform": "p"},
                model={"weight_bytes": 1 << 30, "layers": 17, "shards": 2})
    bench_docs.write_block(readme, bench_coldstart_report.BEGIN, bench_coldstart_report.END, bench_coldstart_report.readme_block(data))
    text = readme.read_text()
    assert "STALE-TEXT" not in text and text.startswith("# x\nbefore\n") and text.endswith("\nafter\n")
    assert "1.00 GiB float32 Llama (17 layers, 2 shards)" in text
    with pytest.raises(SystemExit, match="needs exactly one"):
        bench_docs.write_block(_without_markers(tmp_path), bench_coldstart_report.BEGIN, bench_coldstart_report.END, "x")


def _without_markers(tmp_path: Path) -> Path:
    p = tmp_path / "plain.md"
    p.write_text("no markers\n")
    return p


def test_llama_layers_for_hits_the_size():
    layers = bench_models.llama_layers_for(1 << 30, 1000)
    assert 15 <= layers <= 19  # ~60 MiB per float32 layer
    assert bench_models.llama_layers_for(1, 1000) == 1


def test_every_method_has_its_env_and_the_shim_is_only_on_for_the_shim():
    assert set(bench_coldstart.METHOD_ENV) == set(bench_coldstart.METHODS)
    for method, env in bench_coldstart.METHOD_ENV.items():
        assert ("RAY_RUNAI_SHIM_DISABLE" in env) == (method != "shim")
