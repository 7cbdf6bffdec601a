"""The README example (``examples/stream_from_s3.py``: Ray Data's vLLM stage) run in a sandbox,
with or without the shim; shared by the pipeline test, the oracle and the matrix's sharded run."""

from __future__ import annotations

import json
import subprocess
import sys

from support.procs import REPO


def run_example(sandbox, uri: str, shim: bool, load_format: str = "runai_streamer", check: bool = True) -> dict:
    env = dict(sandbox.env)
    if not shim:
        env.update(RAY_RUNAI_SHIM_DISABLE="1", RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")
    out = sandbox.root / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "stream_from_s3.py"), uri, "--cpu", "--json", str(out),
         "--load-format", load_format],
        env=env,
        cwd=str(sandbox.root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = "\n".join(p.read_text(errors="replace") for p in sandbox.root.glob("tmp/ray/session_2*/logs/worker-*"))
    if not check and proc.returncode != 0:
        return {"rows": None, "stderr": proc.stderr, "worker_logs": logs}
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {"rows": json.loads(out.read_text())["rows"], "stderr": proc.stderr, "worker_logs": logs}
