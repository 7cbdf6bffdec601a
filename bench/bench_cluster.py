"""Benchmark: one store read per Ray cluster -- M nodes x N readers, one shared link to the store.

A real Ray cluster of M nodes on this machine (``ray start``; each node with its own HOME,
TMPDIR and relay directory), N readers per node, each a Ray actor pinned to its node that
loads every tensor as a vLLM rank does with the shim (``relay.acquire`` then the copy read as
it lands, each tensor copied once as into a parameter). One 40 MB/s link to the store for the
whole cluster (s3rver behind one counting, rate-limiting proxy). Side by side:

* ``cluster``: the shim's default: the first node reads the store, the other nodes take the
  ranges from it through Ray's object store (``snapshot/relay_cluster.py``);
* ``node``:    the node relay alone (``RAY_RUNAI_SHIM_CLUSTER_RELAY=off``): every node reads S.

Per run: weight bytes the store sent (x S), wall time from the go (every reader's imports
done) to the last reader ready, each node's relay-copy peak plus its readers' RSS (without the
copy's shared pages). Goals: store <= 1.05 x S for every M; wall(M = 3) / wall(M = 1) <= 1.2.

    ./dev bench cluster                          # 1 GiB, M = 1,2,3, N = 1,2, 40 MB/s
    ./dev bench cluster --size-gib 0.1 --ms 1,2  # a quick look
    ./dev bench cluster --docs docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import bench_docs
from bench_common import dir_bytes, raise_on_signal, ratio, rss_bytes, stop_and_clean, write_results
from bench_models import GIB, build_model, make_noise, upload_dir
from bench_report import env_info
from bench_servers import BUCKET, S3rver, ensure_s3rver, s3_client  # also puts tests/ on sys.path
from support.cluster import RayCluster
from support.procs import base_env
from support.proxy import CountingProxy

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSON = BENCH_DIR / "results" / "cluster.json"
BEGIN = "<!-- bench-cluster:begin -->"
END = "<!-- bench-cluster:end -->"
PAGE = "benchmarks.md"
METHODS = ("cluster", "node")
STORE_GOAL = 1.05
WALL_GOAL = 1.2

DRIVER = r"""
import json, os, sys, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

args = json.loads(sys.argv[1])
ray.init(address=args["address"], logging_level="WARNING")


@ray.remote(num_cpus=0)
class Reader:
    def ready(self):
        import torch  # noqa: F401
        from ray_runai_shim.snapshot import relay, relay_read  # noqa: F401
        return os.getpid()

    def load(self, uri, endpoint, weights):
        import torch
        from ray_runai_shim.snapshot import relay, relay_read
        from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

        t0 = time.time()
        got = relay.acquire(uri, lambda u: (endpoint_s3_filesystem(False, endpoint), u.split("://", 1)[1]),
                            pipelined=True)
        if got is None:
            raise RuntimeError("no relay copy")
        live = relay_read.open_live(got.path) if got.live else None
        if live is not None:
            tensors = live.tensors()
        else:
            from safetensors.torch import load_file
            tensors = ((k, v) for w in weights for k, v in load_file(str(got.path / w)).items())
        n = 0
        for _name, t in tensors:
            p = torch.empty_like(t)
            p.copy_(t)  # vLLM copies each tensor into its parameter
            n += 1
        done = time.time()
        got.wait()
        relay.release(got)
        return {"t0": t0, "ready_at": done, "tensors": n, "fetched": got.fetched, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}


nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
readers = [Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
           for node in nodes for _ in range(args["n"])]
pids = ray.get([r.ready.remote() for r in readers])
print("PIDS " + json.dumps(pids), flush=True)
sys.stdin.readline()  # the go: the parent's samplers run
go = time.time()
out = ray.get([r.load.remote(args["uri"], args["endpoint"], args["weights"]) for r in readers], timeout=3600)
print("RESULT " + json.dumps({"go": go, "readers": out}), flush=True)
"""


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,3, got {text!r}")
    return values


def measure(method: str, m: int, n: int, model: dict, proxy: CountingProxy, store_env: dict[str, str]) -> dict[str, Any]:
    """One cluster of *m* nodes, *n* readers each, all loading the model at once."""

    root = Path(tempfile.mkdtemp(prefix="rrs-bc-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = base_env({**store_env, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ENDPOINT_URL_S3": proxy.endpoint,
                    "RAY_RUNAI_SHIM_CLUSTER_RELAY": "auto" if method == "cluster" else "off"})
    row: dict[str, Any] = {"method": method, "m": m, "n": n}
    try:
        return _measure(method, m, n, model, proxy, env, root, row)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(method: str, m: int, n: int, model: dict, proxy: CountingProxy, env: dict[str, str], root: Path,
             row: dict[str, Any]) -> dict[str, Any]:
    import subprocess

    relay_dirs = []
    with RayCluster(env, root=root / "cluster") as cluster:
        store_bytes = 2 * model["weight_bytes"] + (256 << 20)  # the source's objects and room besides
        for i in range(m):
            node = root / f"node{i}"
            for sub in ("home", "tmp", "relay"):
                (node / sub).mkdir(parents=True)
            relay_dirs.append(node / "relay")
            start = cluster.start_head if i == 0 else cluster.add_node
            start("--num-cpus=1", "--num-gpus=0", f"--object-store-memory={store_bytes}",
                  env={"HOME": str(node / "home"), "TMPDIR": str(node / "tmp"),
                       "RAY_RUNAI_SHIM_RELAY_DIR": str(node / "relay")})
        args = {"address": cluster.address, "n": n, "uri": model["uri"], "endpoint": proxy.endpoint,
                "weights": model["weights"]}
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            if not line.startswith("PIDS "):
                raise RuntimeError(f"the driver did not start its readers: {line}{proc.stderr.read()[-3000:]}")
            pids = json.loads(line[5:])
            before = proxy.body_bytes(".safetensors")
            peaks = [0] * m
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.2):
                    for i in range(m):
                        own = dir_bytes(relay_dirs[i]) + sum(rss_bytes(p) for p in pids[i * n:(i + 1) * n])
                        peaks[i] = max(peaks[i], own)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=3600)
            stop.set()
            sampler.join(timeout=5)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"the driver failed: {err[-3000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        weights = proxy.body_bytes(".safetensors") - before
    ready = [r["ready_at"] - result["go"] for r in result["readers"]]
    row.update(wall_s=max(ready), store_bytes=weights, store_x=weights / model["weight_bytes"],
               node_peak_bytes=peaks, ready_s=[round(v, 2) for v in ready],
               exact=all(r["tensors"] == model["tensors"] for r in result["readers"]))
    return row


def count_tensors(folder: Path) -> int:
    """The tensors of every safetensors file in *folder*, from their headers."""
    import struct

    count = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            count += sum(1 for k in json.loads(f.read(n)) if k != "__metadata__")
    return count


def table(data: dict[str, Any]) -> str:
    rows = ["| method | M nodes | N per node | wall (all ready) | store weight bytes | peak per node (relay copy + readers) |",
            "|---|---|---|---|---|---|"]
    for r in data["runs"]:
        if "error" in r:
            rows.append(f"| {r['method']} | {r['m']} | {r['n']} | failed: {r['error'][:120]} | - | - |")
            continue
        peaks = " / ".join(f"{p / (1 << 20):,.0f}" for p in r["node_peak_bytes"])
        rows.append(f"| {r['method']} | {r['m']} | {r['n']} | {r['wall_s']:.2f} s | {r['store_x']:.2f} x S | "
                    f"{peaks} MiB |")
    rows += ["", "| goal | value | met |", "|---|---|---|"]
    for g in data["goals"]:
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
        rows.append(f"| {g['name']} | {value} | {met} |")
    return "\n".join(rows)


def goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in runs if "error" not in r]
    out = []
    for r in ok:
        if r["method"] == "cluster":
            out.append({"name": f"store / S, cluster, M = {r['m']}, N = {r['n']} (<= {STORE_GOAL})",
                        "value": r["store_x"], "met": r["store_x"] <= STORE_GOAL})
    for method in METHODS:
        for n in sorted({r["n"] for r in ok}):
            walls = {r["m"]: r["wall_s"] for r in ok if r["method"] == method and r["n"] == n}
            if 1 in walls and len(walls) > 1:
                top = max(walls)
                value = ratio(walls[top], walls[1])
                applies = method == "cluster"
                out.append({"name": f"wall(M = {top}) / wall(M = 1), {method}, N = {n}"
                            + (f" (<= {WALL_GOAL})" if applies else " (the node relay alone, for comparison)"),
                            "value": value, "met": (value <= WALL_GOAL) if applies and value is not None else None})
    return out


def readme_block(data: dict[str, Any]) -> str:
    m = data["model"]
    head = (f"Generated by `./dev bench cluster` on {data['when']} ({data['env'].get('cpus', '?')} CPUs): a "
            f"{m['size_gib']:g} GiB synthetic safetensors checkpoint (S; {m['shards']} shard(s)) on s3rver behind one "
            f"counting proxy limited to {data['rate_mbps']:g} MB/s for the whole cluster; a real `ray start` cluster "
            "of M nodes on this machine (each its own HOME, TMPDIR and relay directory), N reader actors per node, "
            "each loading every tensor as a vLLM rank with the shim does (the relay, read as it lands, a copy per "
            "tensor); wall time from the go (imports done) to the last reader ready.")
    return f"{BEGIN}\n{head}\n\n{table(data)}\n{END}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="weight GiB of the model (default 1)")
    ap.add_argument("--ms", type=parse_ints, default=[1, 2, 3], help="nodes in the cluster (default 1,2,3)")
    ap.add_argument("--ns", type=parse_ints, default=[1, 2], help="readers per node (default 1,2)")
    ap.add_argument("--rate-mbps", type=float, default=40.0, help="MB/s of the cluster's link to the store")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {','.join(METHODS)}")
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--docs", type=Path, metavar="PATH", help="rewrite the bench-cluster block of this page")
    args = ap.parse_args(argv)
    methods = [x for x in args.methods.split(",") if x]
    if any(x not in METHODS for x in methods):
        ap.error(f"--methods: some of {','.join(METHODS)}")
    doc = bench_docs.page(args.docs, PAGE) if args.docs else None
    if doc is not None and not bench_docs.has_block(doc, BEGIN, END):
        ap.error(f"{doc} needs exactly one {BEGIN} ... {END} block")
    signal.signal(signal.SIGTERM, raise_on_signal)
    signal.signal(signal.SIGHUP, raise_on_signal)
    size = int(args.size_gib * GIB)
    workdir = Path(tempfile.mkdtemp(prefix="ray-runai-bench-cluster-", dir=args.tmp))
    server: Optional[S3rver] = None
    runs: list[dict[str, Any]] = []
    try:
        server = S3rver(ensure_s3rver(), workdir / "s3rver-data", workdir / "s3rver.log")
        server.start()
        client = s3_client(server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        prefix = f"models/cluster-{args.size_gib:g}gib"
        model = build_model(workdir / "src" / prefix, size, make_noise(min(64 << 20, size)), shard_max_bytes=size)
        model["tensors"] = count_tensors(workdir / "src" / prefix)
        upload_dir(client, workdir / "src" / prefix, prefix)  # removes the local files
        model.update(uri=f"s3://{BUCKET}/{prefix}", size_gib=args.size_gib,
                     weights=sorted(k for k in model["files"] if k.endswith(".safetensors")))
        print(f"{model['uri']}: S = {model['weight_bytes']:,} weight bytes", flush=True)
        with CountingProxy(server.port, rate=args.rate_mbps * 1e6) as proxy:
            for method in methods:
                for n in args.ns:
                    for m in args.ms:
                        try:
                            row = measure(method, m, n, model, proxy, server.env())
                        except Exception as e:
                            last = (str(e).strip().splitlines() or [""])[-1][:300]
                            row = {"method": method, "m": m, "n": n, "error": f"{type(e).__name__}: {last}"}
                        runs.append(row)
                        print(json.dumps({k: v for k, v in row.items()}), flush=True)
        data = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "env": env_info(), "rate_mbps": args.rate_mbps,
                "model": {k: v for k, v in model.items() if k != "files"}, "runs": runs, "goals": goals(runs),
                "command": [sys.executable, *sys.argv]}
        print()
        print(table(data))
        write_results(RESULTS_JSON, data, doc, BEGIN, END, readme_block(data) if doc is not None else "")
        return 1 if any("error" in r for r in runs) else 0
    finally:
        stop_and_clean(server, workdir)


if __name__ == "__main__":
    sys.exit(main())
