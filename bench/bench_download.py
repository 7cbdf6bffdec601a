"""Benchmark: Ray 2.48's full model download vs the shim's non-weight fetch, from a local S3.

Why: the shim's claim is that, with a streaming ``load_format``, the vLLM stage
no longer pays for copying the weights to local disk (time, disk, and memory,
since Ray reads each object whole). This script shows that claim with numbers
on real HTTP against s3rver (moto copies whole objects per GET and does not
scale to GiB objects), one fresh subprocess per measurement so peak RSS is
per method, and cleans every big file up afterwards, even on failure.

Run: ``./dev bench [--sizes 1,2,4]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
S3RVER_VERSION = "3.7.1"
S3RVER_PREFIX = BENCH_DIR / ".s3rver"
RESULTS_JSON = BENCH_DIR / "results" / "latest.json"
BUCKET = "bench"
GIB = 1 << 30
MIB = 1 << 20
SHARD_MAX_BYTES = GIB  # shards of ~1 GiB max, like HF's default max_shard_size range
TENSOR_COLS = 8192  # float16 -> 16 KiB per row
TENSOR_MAX_ROWS = 4096  # -> 64 MiB per tensor
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


# --------------------------------------------------------------------------- s3rver


def free_port() -> int:
    """A currently free loopback port (racy, fine on a bench box)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_s3rver() -> Path:
    """Install s3rver into bench/.s3rver once; return its CLI script."""
    cli = S3RVER_PREFIX / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    if cli.is_file():
        return cli
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH; s3rver (a Node package) is needed for this benchmark")
    print(f"installing s3rver@{S3RVER_VERSION} into {S3RVER_PREFIX} ...", flush=True)
    S3RVER_PREFIX.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            npm,
            "install",
            "--prefix",
            str(S3RVER_PREFIX),
            "--no-audit",
            "--no-fund",
            f"s3rver@{S3RVER_VERSION}",
        ],
        check=True,
    )
    if not cli.is_file():
        raise RuntimeError(f"npm install finished but {cli} is missing")
    return cli


class S3rver:
    """An s3rver subprocess on 127.0.0.1 with an on-disk data dir (big objects stay off the heap)."""

    def __init__(self, cli: Path, data_dir: Path, log_path: Path) -> None:
        self.cli = cli
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self, timeout: float = 30.0) -> None:
        """Start and wait until it answers HTTP."""
        node = shutil.which("node") or "node"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    node,
                    str(self.cli),
                    "-d",
                    str(self.data_dir),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "--no-vhost-buckets",
                    "--allow-mismatched-signatures",
                    "-s",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"s3rver exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP answer means it is serving
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"s3rver did not answer on {self.endpoint}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def env(self) -> dict[str, str]:
        """What boto3, pyarrow (through the shim's endpoint patch) and the streamer read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "S3RVER",
            "AWS_SECRET_ACCESS_KEY": "S3RVER",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_S3_ADDRESSING_STYLE": "path",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }


def s3_client(endpoint: str) -> Any:
    """A path-style boto3 client for s3rver."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="S3RVER",
        aws_secret_access_key="S3RVER",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
    )


# --------------------------------------------------------------------------- synthetic model


def _noise(nbytes: int) -> bytes:
    """Plausible float16 weights (N(0, 0.02)), generated once and reused for every tensor."""
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.02).astype(np.float16).tobytes()


def write_shard(path: Path, tensors: list[tuple[str, int]], noise: bytes) -> int:
    """Write a valid safetensors file by hand (header + raw F16 rows); return its size.

    Written by hand rather than with ``safetensors.numpy.save_file`` so a GiB
    shard never has to exist in memory: the same noise block is written repeatedly.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, rows in tensors:
        n = rows * TENSOR_COLS * 2
        header[name] = {"dtype": "F16", "shape": [rows, TENSOR_COLS], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _name, rows in tensors:
            left = rows * TENSOR_COLS * 2
            while left:
                piece = min(left, len(noise))
                f.write(noise[:piece])
                left -= piece
    return path.stat().st_size


def build_model(out: Path, weight_bytes: int, noise: bytes) -> dict[str, Any]:
    """A Llama-shaped prefix: small config/tokenizer files plus ceil(size/1 GiB) shards."""
    out.mkdir(parents=True, exist_ok=True)
    small = {
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": TENSOR_COLS,
            "num_hidden_layers": 1,
            "vocab_size": 32000,
            "torch_dtype": "float16",
        },
        "tokenizer.json": {
            "version": "1.0",
            "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(2000)}, "merges": []},
        },
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096},
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 16},
    }
    for name, obj in small.items():
        (out / name).write_text(json.dumps(obj, indent=1))
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    row_bytes = TENSOR_COLS * 2
    total_rows = max(1, weight_bytes // row_bytes)
    n_shards = max(1, math.ceil(total_rows * row_bytes / SHARD_MAX_BYTES))
    rows_per_shard = math.ceil(total_rows / n_shards)
    weight_map: dict[str, str] = {}
    shards: list[Path] = []
    t = 0
    for i in range(n_shards):
        rows_left = min(rows_per_shard, total_rows - i * rows_per_shard)
        name = "model.safetensors" if n_shards == 1 else f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors: list[tuple[str, int]] = []
        while rows_left > 0:
            rows = min(TENSOR_MAX_ROWS, rows_left)
            tensors.append((f"model.layers.{t}.mlp.weight", rows))
            weight_map[f"model.layers.{t}.mlp.weight"] = name
            rows_left -= rows
            t += 1
        write_shard(out / name, tensors, noise)
        shards.append(out / name)
    if n_shards > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": total_rows * row_bytes}, "weight_map": weight_map}, indent=1
            )
        )
    from safetensors import safe_open  # cheap validity check: parses each header

    for shard in shards:
        with safe_open(str(shard), "np") as f:
            assert len(list(f.keys())) > 0, shard
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return {
        "files": files,
        "weight_bytes": sum(s for n, s in files.items() if n.endswith(".safetensors")),
        "nonweight_bytes": sum(s for n, s in files.items() if not n.endswith(".safetensors")),
        "shards": n_shards,
    }


def upload_dir(client: Any, local: Path, prefix: str, delete_after: bool = True) -> float:
    """Multipart-upload every file; delete each local copy once uploaded (saves disk)."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=64 * MIB, multipart_chunksize=64 * MIB, max_concurrency=4)
    start = time.perf_counter()
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}", Config=cfg)
        if delete_after:
            path.unlink()
    return time.perf_counter() - start


def delete_prefix(client: Any, prefix: str) -> None:
    """Free the server's disk copy of one size's model."""
    resp = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    keys = [{"Key": o["Key"]} for o in resp.get("Contents", [])]
    if keys:
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


# --------------------------------------------------------------------------- children


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

    from ray_runai_shim import fetch

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
                    str(Path(__file__).resolve()),
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


# --------------------------------------------------------------------------- report


def _trend(values: list[float], tol: float = 0.25, abs_tol: float = 0.0) -> str:
    """'flat' if last/first stays within ±tol (or the change is under abs_tol), else 'rises'/'falls'.

    abs_tol exists for sub-second timings, where a 0.1 s jitter is a large factor but means nothing.
    """
    if len(values) < 2 or values[0] <= 0:
        return "n/a (one size)"
    f = values[-1] / values[0]
    if abs(values[-1] - values[0]) < abs_tol:
        return f"flat within noise (x{f:.2f}, but |change| < {abs_tol:g} s)"
    if abs(f - 1) <= tol:
        return f"flat (x{f:.2f} from first to last size)"
    return f"{'rises' if f > 1 else 'falls'} (x{f:.2f} from first to last size)"


def report(rows: list[dict[str, Any]], imp: dict[str, Any]) -> dict[str, Any]:
    """Print the table, ratios, and trends; return the summary for the JSON."""
    hdr = (
        f"{'size GiB':>8} | {'method':<9} | {'wall s':>7} | {'weight bytes on disk':>20} | "
        f"{'non-weight bytes':>16} | {'peak RSS MiB':>12}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['size_gib']:>8g} | {r['method']:<9} | {r['wall_s']:>7.2f} | {r['weight_bytes']:>20,} | "
            f"{r['nonweight_bytes']:>16,} | {r['peak_rss_mib']:>12.0f}"
        )
    print()
    sizes = sorted({r["size_gib"] for r in rows})
    by = {(r["size_gib"], r["method"]): r for r in rows}
    ratios = []
    hdr2 = (
        f"{'size GiB':>8} | {'wall shim/unpatched':>19} | {'RSS shim/unpatched':>18} | "
        f"{'unpatched MB/s':>14} | {'unpatched RSS over pre-download MiB':>35}"
    )
    print(hdr2)
    print("-" * len(hdr2))
    for s in sizes:
        u, m = by[(s, "unpatched")], by[(s, "shim")]
        rw, rr = m["wall_s"] / u["wall_s"], m["peak_rss_mib"] / u["peak_rss_mib"]
        mbps = u["weight_bytes"] / MIB / u["wall_s"]
        growth = u["peak_rss_mib"] - u["rss_before_download_mib"]
        ratios.append({"size_gib": s, "wall_ratio": rw, "rss_ratio": rr})
        print(f"{s:>8g} | {rw:>19.4f} | {rr:>18.3f} | {mbps:>14.0f} | {growth:>35.0f}")
    trends = {
        "wall_ratio": _trend([r["wall_ratio"] for r in ratios]),
        "rss_ratio": _trend([r["rss_ratio"] for r in ratios]),
        "shim_wall_s": _trend([by[(s, "shim")]["wall_s"] for s in sizes], abs_tol=0.25),
        "shim_peak_rss": _trend([by[(s, "shim")]["peak_rss_mib"] for s in sizes]),
        "unpatched_wall_s": _trend([by[(s, "unpatched")]["wall_s"] for s in sizes]),
        "unpatched_peak_rss": _trend([by[(s, "unpatched")]["peak_rss_mib"] for s in sizes]),
    }
    print()
    for k, v in trends.items():
        print(f"trend of {k:<19} as size grows: {v}")
    checks = []
    for s in sizes:
        u, m = by[(s, "unpatched")], by[(s, "shim")]
        checks.append(
            f"{s:g} GiB: unpatched wrote {u['weight_bytes']:,} of {u['expected_weight_bytes']:,} weight "
            f"bytes ({'complete' if u['weight_bytes'] == u['expected_weight_bytes'] else 'INCOMPLETE'}); "
            f"shim wrote {m['weight_bytes']:,} weight bytes, fetched {m['fetched_files']} files / "
            f"{m['fetched_bytes']:,} B = listed non-weights {m['listed_nonweight_bytes']:,} B"
            f"{'' if not u['child_log_errors'] else '; Ray logged errors: ' + repr(u['child_log_errors'])}"
        )
    print()
    for c in checks:
        print("check:", c)
    print(
        f"\nimport ray_runai_shim (fresh interpreter, median of {imp['runs']}): {imp['median_ms']:.1f} ms "
        f"(samples {', '.join(f'{x:.1f}' for x in imp['samples_ms'])}); "
        f"ray in sys.modules: {imp['ray_in_sys_modules']}; vllm: {imp['vllm_in_sys_modules']}; "
        f"wrapt: {imp['wrapt_in_sys_modules']}; pyarrow: {imp['pyarrow_in_sys_modules']}"
    )
    return {"ratios": ratios, "trends": trends, "checks": checks}


# --------------------------------------------------------------------------- main


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # so the finally-block cleanup runs on SIGTERM/SIGHUP


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

    signal.signal(signal.SIGTERM, _raise_on_signal)
    signal.signal(signal.SIGHUP, _raise_on_signal)
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
        noise = _noise(64 * MIB)
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
                    "env": _env_info(),
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
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"cleaned up s3rver and {workdir}", flush=True)


def _env_info() -> dict[str, Any]:
    """Versions and box shape, so numbers are comparable across runs."""
    import importlib.metadata as md

    vers = {}
    for dist in ("ray", "pyarrow", "boto3", "safetensors", "numpy", "transformers"):
        try:
            vers[dist] = md.version(dist)
        except md.PackageNotFoundError:
            vers[dist] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "s3rver": S3RVER_VERSION,
        **vers,
    }


if __name__ == "__main__":
    sys.exit(main())
