"""Benchmark: Ray 2.48's full model download vs the shim's non-weight fetch, from a local S3.

Why: the shim's claim is that, with a streaming ``load_format``, the vLLM stage
no longer pays for copying the weights to local disk (time, disk, and memory,
since Ray reads each object whole). This script shows that claim with numbers
on real HTTP against s3rver (moto copies whole objects per GET and does not
scale to GiB objects), one fresh subprocess per measurement so peak RSS is
per method, and cleans every big file up afterwards, even on failure.

Run: ``./dev bench [--sizes 1,2,4]``.

The parts: ``bench_servers`` (s3rver), ``bench_models`` (synthetic checkpoints),
``bench_measure`` (child-process measurements), ``bench_report`` (tables); this
file is the CLI and the run itself. See bench/README.md.
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

from bench_common import raise_on_signal, stop_and_clean
from bench_measure import child_main, measure_import, run_child
from bench_models import GIB, MIB, build_model, delete_prefix, make_noise, upload_dir
from bench_report import env_info, report
from bench_servers import BUCKET, S3RVER_VERSION, S3rver, ensure_s3rver, s3_client

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSON = BENCH_DIR / "results" / "latest.json"



def parse_sizes(text: str) -> list[float]:
    """'1,2,4' or '0.25' -> GiB floats."""
    sizes = [float(x) for x in text.split(",") if x.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes must be positive GiB values, e.g. 1,2,4 or 0.25")
    return sizes


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", type=parse_sizes, default=[1.0, 2.0, 4.0], help="weight GiB per model (default 1,2,4)"
    )
    ap.add_argument(
        "--tmp", default=tempfile.gettempdir(), help="where the temp data goes (default: system tmp)"
    )
    ap.add_argument("--import-runs", type=int, default=5)
    ap.add_argument("--child", choices=["unpatched", "shim"], help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.child, args.uri, args.result)
        return 0

    # Peak disk per size: server copy + one download (local sources are deleted as they upload,
    # and each size is deleted from the server before the next one).
    need = 2.2 * max(args.sizes) * GIB + 512 * MIB
    free = shutil.disk_usage(args.tmp).free
    subprocess.run(["df", "-h", args.tmp], check=False)
    if free < need:
        print(f"not enough space in {args.tmp}: need ~{need / GIB:.1f} GiB, have {free / GIB:.1f} GiB")
        return 2

    signal.signal(signal.SIGTERM, raise_on_signal)
    signal.signal(signal.SIGHUP, raise_on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="ray-runai-bench-", dir=args.tmp))
    server: Optional[S3rver] = None
    rows: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    try:
        server = S3rver(ensure_s3rver(), workdir / "s3rver-data", workdir / "s3rver.log")
        server.start()
        os.environ.update(server.env())
        print(f"s3rver {S3RVER_VERSION} at {server.endpoint}, data in {server.data_dir}", flush=True)
        client = s3_client(server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        t = time.perf_counter()
        noise = make_noise(64 * MIB)
        print(f"noise block ready in {time.perf_counter() - t:.1f}s", flush=True)

        for size in args.sizes:
            prefix = f"models/synthetic-{size:g}gib"
            uri = f"s3://{BUCKET}/{prefix}"
            t = time.perf_counter()
            model = build_model(workdir / "src" / prefix, int(size * GIB), noise)
            gen_s = time.perf_counter() - t
            up_s = upload_dir(client, workdir / "src" / prefix, prefix)
            model.update(size_gib=size, uri=uri, generate_s=gen_s, upload_s=up_s)
            models.append(model)
            print(
                f"{uri}: {model['shards']} shard(s), {model['weight_bytes']:,} weight B, "
                f"{model['nonweight_bytes']:,} non-weight B; generated {gen_s:.1f}s, uploaded {up_s:.1f}s",
                flush=True,
            )
            for method in ("unpatched", "shim"):
                r = run_child(method, uri, workdir)
                r.update(size_gib=size, expected_weight_bytes=model["weight_bytes"])
                rows.append(r)
                print(
                    f"  {method:<9} wall {r['wall_s']:.2f}s  peak RSS {r['peak_rss_mib']:.0f} MiB  "
                    f"weight B on disk {r['weight_bytes']:,}",
                    flush=True,
                )
            delete_prefix(client, prefix)

        imp = measure_import(args.import_runs)
        summary = report(rows, imp)
        RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_JSON.write_text(
            json.dumps(
                {
                    "command": [sys.executable, *sys.argv],
                    "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "env": env_info(),
                    "models": models,
                    "rows": rows,
                    "import": imp,
                    **summary,
                },
                indent=1,
            )
        )
        print(f"\nwrote {RESULTS_JSON}")
        return 0
    finally:
        stop_and_clean(server, workdir)


if __name__ == "__main__":
    sys.exit(main())
