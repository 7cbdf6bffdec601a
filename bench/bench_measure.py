"""bench part: one measurement per fresh child process, and what it left on disk.

Each method runs in its own interpreter with its own ``HF_HOME``/``HOME``, so peak
RSS (``ru_maxrss``) belongs to that method alone; the child is this same CLI,
``bench_download.py --child METHOD``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CLI = BENCH_DIR / "bench_download.py"  # the child is the CLI in --child mode
CHILD_TIMEOUT_S = 3600
# Scratch-only env that would redirect where either method writes: dropped in children.
_CHILD_ENV_DROP = (
    "RAY_RUNAI_SHIM_DISABLE",
    "RAY_RUNAI_SHIM_CACHE_DIR",
    "TRANSFORMERS_CACHE",
    "HF_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
)


def walk_bytes(roots: list[Path]) -> dict[str, Any]:
    """Bytes of files under *roots*, split by the .safetensors suffix."""
    weight = nonweight = 0
    weight_files: list[str] = []
    for root in roots:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = Path(dirpath, name)
                if p.is_symlink():
                    continue
                size = p.stat().st_size
                if name.endswith(".safetensors"):
                    weight += size
                    weight_files.append(str(p.relative_to(root)))
                else:
                    nonweight += size
    return {"weight_bytes": weight, "nonweight_bytes": nonweight, "weight_files": sorted(weight_files)}


def child_main(method: str, uri: str, result_path: Path) -> None:
    """One measurement in a fresh interpreter; both methods do identical imports first."""
    import resource

    t_imp = time.perf_counter()
    # Environment adapter, NOT part of the shim: Ray 2.48 imports
    # transformers.utils.hub.TRANSFORMERS_CACHE, which transformers 5 removed.
    import transformers.utils.hub as h
    from huggingface_hub import constants

    import ray_runai_shim  # noqa: F401  - patches CloudFileSystem.get_fs_and_path for AWS_ENDPOINT_URL

    h.TRANSFORMERS_CACHE = constants.HF_HUB_CACHE

    from ray.llm._internal.common.utils import download_utils

    from ray_runai_shim.snapshot import fetch

    import_s = time.perf_counter() - t_imp
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    if method == "unpatched":
        # Ray's own, unmodified full download (only the vLLM stage's call is narrowed by the shim).
        dest = download_utils.download_model_files(
            model_id=uri,
            mirror_config=None,
            download_model=download_utils.NodeModelDownloadable.MODEL_AND_TOKENIZER,
            download_extra_files=False,
        )
    elif method == "shim":
        res = fetch.fetch_nonweights(uri, "runai_streamer")
        dest = res.local_dir
        extra = {
            "fetched_files": res.fetched_files,
            "fetched_bytes": res.fetched_bytes,
            "reused": res.reused,
            "listed_weight_bytes": res.listing.weight_bytes,
            "listed_nonweight_bytes": res.listing.nonweight_bytes,
        }
    else:
        raise SystemExit(f"unknown method {method!r}")
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    # Walk all of this run's scratch (HF_HOME and HOME), not just the returned dir,
    # so weight bytes written anywhere would be counted.
    disk = walk_bytes([Path(os.environ["HF_HOME"]), Path(os.environ["HOME"])])
    result_path.write_text(
        json.dumps(
            {
                "method": method,
                "dest": str(dest),
                "wall_s": wall,
                "import_s": import_s,
                "peak_rss_mib": peak_kib / 1024,
                "rss_before_download_mib": rss_before_kib / 1024,
                **disk,
                **extra,
            }
        )
    )


def run_child(method: str, uri: str, workdir: Path) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess with its own HF_HOME/HOME; delete them after."""
    scratch = Path(tempfile.mkdtemp(prefix=f"run-{method}-", dir=workdir))
    try:
        env = {k: v for k, v in os.environ.items() if k not in _CHILD_ENV_DROP}
        env["HF_HOME"] = str(scratch / "hf")
        env["HOME"] = str(scratch / "home")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        (scratch / "home").mkdir()
        result = scratch / "result.json"
        log = scratch / "child.log"
        with open(log, "wb") as lf:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(CLI),
                    "--child",
                    method,
                    "--uri",
                    uri,
                    "--result",
                    str(result),
                ],
                env=env,
                stdout=lf,
                stderr=subprocess.STDOUT,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
        if proc.returncode != 0 or not result.is_file():
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{method} child failed (rc={proc.returncode}):\n{tail}")
        out = json.loads(result.read_text())
        # Ray's download_files logs and swallows errors; surface them instead of trusting the numbers.
        text = log.read_text(errors="replace")
        out["child_log_errors"] = [ln for ln in text.splitlines() if "Error downloading" in ln][:5]
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure_import(runs: int) -> dict[str, Any]:
    """``import ray_runai_shim`` in fresh interpreters: median seconds, and what it pulled in."""
    code = (
        "import json,sys,time\n"
        "t=time.perf_counter()\n"
        "import ray_runai_shim\n"
        "dt=time.perf_counter()-t\n"
        "print(json.dumps({'s':dt,'ray':'ray' in sys.modules,'vllm':'vllm' in sys.modules,"
        "'wrapt':'wrapt' in sys.modules,'pyarrow':'pyarrow' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_RUNAI_SHIM_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    samples = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
    secs = [s["s"] for s in samples]
    return {
        "runs": runs,
        "median_ms": statistics.median(secs) * 1000,
        "samples_ms": [s * 1000 for s in secs],
        "ray_in_sys_modules": any(s["ray"] for s in samples),
        "vllm_in_sys_modules": any(s["vllm"] for s in samples),
        "wrapt_in_sys_modules": any(s["wrapt"] for s in samples),
        "pyarrow_in_sys_modules": any(s["pyarrow"] for s in samples),
    }
