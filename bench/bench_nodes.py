"""Benchmark: N readers of one model on one node -- each streaming, the node relay, Ray's copy.

Several engines of one model on a node (or the tensor-parallel ranks of one engine) all
load the same weights. This measures, side by side, for N = 1, 2, 4 readers on this node:

* ``stream``:   every reader streams the whole checkpoint from the store itself (the shim
  before the relay; upstream Ray >= 2.51 streams the same way): the node reads N x S.
* ``relay``:    the node relay (``RAY_RUNAI_SHIM_RELAY=on``), as the shim runs it: the first
  reader fetches the weights once into ``/dev/shm`` (``relay.acquire``) and every reader (the
  fetcher too) reads each tensor as soon as its bytes are verified there (#36).
* ``relay-wait``: the relay before #36, for comparison: every reader waits for the whole copy,
  then streams the local files.
* ``auto``:     N = 1 only: the shim's default mode decides (``relay_wanted``): one reader
  keeps streaming from the store, so ``auto/stream`` must stay at 1.
* ``ray-copy``: Ray alone's pattern (2.48's ``CloudFileSystem.download_files``): the first
  reader takes a file lock and copies every object, whole, one after the other, to a local
  disk dir; the others wait on the lock; then every reader streams the local files.

Each reader is a process of its own that loads every tensor with the real Run:ai
``SafetensorsStreamer`` (``tests/support/relaychild.py``). The store is s3rver with a
synthetic checkpoint (``bench_models``) behind one ``CountingProxy`` (``tests/support/proxy.py``):
the node's link to the store, limited to ``--rates`` MB/s (0 = unlimited loopback) and counted.
Per measurement: wall time from the start of all N to the last reader's ready, weight bytes
the store sent (x S), peak node memory (MemAvailable), bytes written to disk.

    ./dev bench nodes                                   # 1 GiB, N = 1,2,4, links 40 MB/s and unlimited
    ./dev bench nodes --size-gib 0.05 --ns 1,2          # a quick look
    ./dev bench nodes --docs docs/benchmarks.md         # also rewrite the bench-nodes block there
    ./dev bench nodes --layouts 1,8                     # one file and 8 shards (the default)
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import bench_docs
from bench_common import dir_bytes, raise_on_signal, ratio, rss_bytes, stop_and_clean, write_results
from bench_models import GIB, MIB, build_model, make_noise, upload_dir
from bench_report import env_info
from bench_servers import BUCKET, REPO_ROOT, S3rver, ensure_s3rver, s3_client  # also puts tests/ on sys.path
from support.proxy import CountingProxy

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSON = BENCH_DIR / "results" / "nodes.json"
BEGIN = "<!-- bench-nodes:begin -->"
END = "<!-- bench-nodes:end -->"
#: The docs page that holds the block (``--docs docs/`` means this file in that folder).
PAGE = "benchmarks.md"
METHODS = ("stream", "auto", "relay", "relay-wait", "relay-budget", "ray-copy")
LABELS = {
    "stream": "every reader streams from the store",
    "auto": "shim default (`auto`): relays only at >= 2 readers, so N = 1 streams",
    "relay": "node relay (`RAY_RUNAI_SHIM_RELAY=on`), as the shim runs it: one fetch into /dev/shm, and every "
             "reader (the fetcher too) reads each tensor as soon as its bytes are verified there",
    "relay-wait": "the node relay before #36: one fetch into /dev/shm, every reader waits for the whole copy, "
                  "then streams it with the shim's memory rule (a 256 MiB buffer each, docs/node-relay.md)",
    "relay-budget": "the node relay with a tighter streamer memory budget (`RUNAI_STREAMER_MEMORY_LIMIT` = "
                    "`--budget-mib` per reader, as the shim sets it on a node short of memory): what the budget costs",
    "ray-copy": "Ray alone: one reader copies every object to disk under a file lock, all stream the copy",
}
#: What N counts, for the docs: at the store, a rank and an engine are the same reader.
READERS_NOTE = (
    "N counts the readers on the node: engines x tensor-parallel ranks (vLLM's runai loader streams the whole "
    "checkpoint in every rank), so N = 2 is one engine at `tensor_parallel_size=2` or two engines, and N = 4 "
    "two engines at TP=2. Native Ray 2.52-2.60 hands vLLM the URI and every reader streams: the `stream` rows.")
DEFAULT_BUDGET_MIB = 128  # the bench model's tensors are 64 MiB
#: The issues' goals: (numerator, its N, denominator, its N, kind, bound, link). kind "max":
#: ratio <= bound; "near": |ratio - 1| <= bound. link: "limited", "unlimited" or "any".
#: #25/#29: the relay against Ray's copy and against every reader streaming, at the same N;
#: #36: the relay against ONE reader streaming (the physical limit is max(copy, one load)).
GOALS = (
    ("relay", 2, "ray-copy", 2, "max", 0.9, "limited"),
    ("relay", 4, "ray-copy", 4, "max", 0.9, "limited"),
    ("relay", 2, "stream", 2, "max", 0.55, "limited"),
    ("relay", 4, "stream", 4, "max", 0.3, "limited"),
    ("relay", 2, "stream", 1, "max", 1.05, "limited"),
    ("relay", 4, "stream", 1, "max", 1.05, "limited"),
    ("relay", 2, "stream", 1, "max", 1.2, "unlimited"),
    ("relay", 4, "stream", 1, "max", 1.5, "unlimited"),
    ("auto", 1, "stream", 1, "near", 0.03, "any"),
)
#: #36: a follower's first tensor, as a share of the copy's duration, from the follower's start.
FIRST_TENSOR_GOAL = 0.10
REQUEST_TIMEOUT_ENV = "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"
ARM_TIMEOUT_S = 300.0  # every reader has imported torch, the streamer and the shim
SAMPLE_S = 0.2
ARMED = "ARMED"
#: The parent's environment minus the shim's switches (the method sets them). RUNAI_STREAMER_*
#: settings of the caller pass through to every reader alike and are recorded in the JSON.
_ENV_DROP_PREFIXES = ("RAY_RUNAI_SHIM",)


# -- pure parts: arguments, plan, ratios, tables, the docs block ----------------------------

def parse_ns(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (readers per node)."""
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ns = []
    if not ns or any(n < 1 for n in ns):
        raise argparse.ArgumentTypeError("--ns takes reader counts >= 1, e.g. 1,2,4")
    return ns


def parse_rates(text: str) -> list[float]:
    """'40,0' -> [40.0, 0.0] (MB/s of the node's link to the store; 0 = unlimited)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError("--rates takes MB/s >= 0 (0 = unlimited), e.g. 40,0")
    return rates


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise argparse.ArgumentTypeError(f"--methods takes some of {','.join(METHODS)}")
    return methods


def plan(ns: list[int], methods: list[str]) -> list[tuple[int, str]]:
    """Every (N, method) to measure, in order; ``auto`` only at N = 1 (at N >= 2 it is ``relay``),
    ``relay-budget`` only at N >= 2 (one reader streams)."""
    return [(n, m) for n in ns for m in METHODS
            if m in methods and (m != "auto" or n == 1) and (m != "relay-budget" or n > 1)]


def run_timeout(n: int, weight_bytes: int, rate_mbps: float) -> float:
    """Seconds one measurement may take: N x S through the link (50 MB/s if unlimited), x4, + 5 min."""
    rate = (rate_mbps or 50.0) * 1e6
    return 300.0 + 4.0 * n * weight_bytes / rate


def rate_label(rate_mbps: float) -> str:
    return "unlimited (loopback through the proxy)" if not rate_mbps else f"{rate_mbps:g} MB/s"



def _wall(rows: list[dict[str, Any]], rate: float, n: int, method: str) -> Optional[float]:
    for r in rows:
        if r["rate_mbps"] == rate and r["n"] == n and r["method"] == method and "error" not in r:
            return r["wall_s"]
    return None


def goal_text(kind: str, bound: float) -> str:
    return f"<= {bound:g}" if kind == "max" else f"within {bound * 100:g} %"


def ratios(rows: list[dict[str, Any]], rate: float) -> list[dict[str, Any]]:
    """The issues' wall-time ratios on one link (rows of one model), each with its goal and
    whether it is met (None: a side is missing or failed, or the goal is for another kind of
    link: then it is listed only where it applies to no link of this run's kind either), then
    the followers' first tensor as a share of the copy's duration (#36)."""
    out = []
    for num, n, den, den_n, kind, bound, link in GOALS:
        applies = link == "any" or (link == "limited") == bool(rate)
        if not applies and (link == "unlimited" or any(
                g[:4] == (num, n, den, den_n) and (g[6] == "any" or (g[6] == "limited") == bool(rate))
                for g in GOALS)):
            continue  # another line judges this ratio on this kind of link
        value = ratio(_wall(rows, rate, n, num), _wall(rows, rate, den_n, den))
        met: Optional[bool] = None
        if value is not None and applies:
            met = value <= bound if kind == "max" else abs(value - 1.0) <= bound
        if value is None and not any(r["rate_mbps"] == rate and r["n"] == n for r in rows):
            continue  # this N was not run at all
        name = f"{num}/{den}" if den_n == n else f"{num}/{den} (N={den_n})"
        out.append({"name": name, "n": n, "value": value, "goal": goal_text(kind, bound),
                    "applies": applies, "met": met})
    for r in rows:
        if r["rate_mbps"] != rate or r["method"] != "relay" or r["n"] < 2 or "error" in r:
            continue
        value = ratio(r.get("follower_first_s"), r.get("copy_s"))
        out.append({"name": "follower's first tensor / copy", "n": r["n"], "value": value,
                    "goal": goal_text("max", FIRST_TENSOR_GOAL), "applies": True,
                    "met": None if value is None else value <= FIRST_TENSOR_GOAL})
    return out


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / MIB:,.0f} MiB"


def method_cell(r: dict[str, Any]) -> str:
    """The method, and for ``auto`` what the shim chose."""
    if r["method"] == "auto" and r.get("auto_relays") is not None:
        return f"auto ({'relays' if r['auto_relays'] else 'streams'})"
    return r["method"]


def _secs(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f} s"


def row_cells(r: dict[str, Any]) -> list[str]:
    """One table row: N, method, wall, a follower's first tensor, store bytes x S, peak node
    memory, the readers' own share, disk."""
    if "error" in r:
        msg = r["error"].strip().splitlines()[0] if r["error"].strip() else "failed"
        msg = msg[:120].replace("|", "\\|")  # a table cell
        return [str(r["n"]), r["method"], f"failed: {msg}", "-", "-", "-", "-", "-"]
    disk = _mib(r["disk_bytes"]) if r["method"] == "ray-copy" else "0"
    return [str(r["n"]), method_cell(r), f"{r['wall_s']:.2f} s", _secs(r.get("follower_first_s")),
            f"{r['store_x']:.2f} x S", _mib(r["peak_mem_bytes"]), _mib(r.get("own_mem_bytes")), disk]


def table_for(rows: list[dict[str, Any]], rate: float, model: str = "") -> str:
    """Markdown: the measurements on one link (of one model), then the goal ratios."""
    mine = [r for r in rows if r["rate_mbps"] == rate]
    lines = [f"{model}Link to the store: **{rate_label(rate)}**", "",
             "| N | method | wall (all N ready) | a follower's first tensor | store weight bytes | peak node memory "
             "| readers' RSS + relay copy | written to disk |",
             "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in mine]
    rat = ratios(rows, rate)
    if rat:
        lines += ["", "| ratio (wall) | N | value | goal | met |", "|---|---|---|---|---|"]
        for x in rat:
            value = "n/a" if x["value"] is None else f"{x['value']:.2f}"
            goal = x["goal"] if x["applies"] else f"({x['goal']} on a limited link)"
            met = {True: "yes", False: "**no**", None: "-"}[x["met"]]
            lines.append(f"| {x['name']} | {x['n']} | {value} | {goal} | {met} |")
    return "\n".join(lines)


def layout_label(shards: Optional[int]) -> str:
    return "" if shards is None else ("One file. " if shards == 1 else f"{shards} shards. ")


def tables(data: dict[str, Any]) -> str:
    """Every model's and link's table, in the order run, and the legend."""
    rows = data["runs"]
    parts = []
    for shards in dict.fromkeys(r.get("shards") for r in rows):
        mine = [r for r in rows if r.get("shards") == shards]
        for rate in dict.fromkeys(r["rate_mbps"] for r in mine):
            parts.append(table_for(mine, rate, layout_label(shards)))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    labels = dict(LABELS, **{"relay-budget": LABELS["relay-budget"].replace(
        "`--budget-mib`", f"{data.get('budget_mib', DEFAULT_BUDGET_MIB)} MiB")})
    parts.append("\n".join(f"- `{m}`: {labels[m]}" for m in methods))
    parts.append(READERS_NOTE)
    return "\n\n".join(parts)


def readme_block(data: dict[str, Any]) -> str:
    """The bench-nodes block of docs/benchmarks.md (markers included), from one run's JSON."""
    model, env = data["model"], data["env"]
    settings = dict(data.get("streamer_env") or {})
    if data.get("request_timeout_ms"):
        settings[REQUEST_TIMEOUT_ENV] = str(data["request_timeout_ms"])
    streamer = ", ".join(f"`{k}={v}`" for k, v in sorted(settings.items())) or "the streamer's defaults"
    return (
        f"{BEGIN}\n"
        f"Generated by `./dev bench nodes` on {data['when']} ({env['cpus']} CPUs, {env['platform']}): a "
        f"{model['weight_bytes'] / GIB:.2f} GiB synthetic safetensors checkpoint (S; {layouts_text(data)}) on "
        f"s3rver behind one counting proxy (the node's link), every reader a process of its own loading every "
        f"tensor with the Run:ai `SafetensorsStreamer` ({streamer}); wall time from the start of all N readers "
        f"(imports done) to the last one ready; peak node memory is the largest drop of MemAvailable during "
        f"the run (every process on the box moves it), next to the growth of the readers' own RSS plus the "
        f"relay copy; the loaded tensors are copied once, as into a parameter, and dropped.\n\n{tables(data)}\n{END}"
    )


def layouts_text(data: dict[str, Any]) -> str:
    shards = sorted({r.get("shards") for r in data["runs"] if r.get("shards")}) or [data["model"].get("shards", 1)]
    return " and ".join("one file" if n == 1 else f"{n} shards" for n in shards)


# -- node memory ---------------------------------------------------------------------------

def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (the package's own reading; a bench needs a number)."""
    from ray_runai_shim.snapshot.memory import mem_available as read

    value = read(meminfo)
    if value is None:
        raise RuntimeError(f"no MemAvailable in {meminfo}")
    return value


class MemSampler:
    """Over a run, sampled every ``interval`` s in a thread: the peak of (baseline - MemAvailable),
    the node's view (every process on the box moves it), and the peak growth of the readers'
    own RSS plus the relay copy in *shm_dir* (the benchmark's share alone)."""

    def __init__(self, pids: tuple[int, ...] = (), shm_dir: Optional[Path] = None,
                 interval: float = SAMPLE_S) -> None:
        self.pids, self.shm_dir, self.interval = pids, shm_dir, interval
        self.baseline = self.own_baseline = 0
        self.peak = self.own_peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _own(self) -> int:
        return sum(rss_bytes(p) for p in self.pids) + (dir_bytes(self.shm_dir) if self.shm_dir else 0)

    def _sample(self) -> None:
        self.peak = max(self.peak, self.baseline - mem_available())
        self.own_peak = max(self.own_peak, self._own() - self.own_baseline)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> MemSampler:
        self.baseline, self.own_baseline, self.peak, self.own_peak = mem_available(), self._own(), 0, 0
        self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling (idempotent); the node's peak in bytes."""
        if not self._stop.is_set():
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._sample()
        return max(0, self.peak)


# -- one reader (this file in --child mode) ----------------------------------------------------

def copy_tensors(paths: list[str]) -> dict[str, str]:
    """What a vLLM rank does with each streamed tensor: its runai iterator clones it out of the
    streamer's reused buffer (``runai_safetensors_weights_iterator``: ``tensor.clone()``), and
    the weight loader copies that into its parameter (here a copy, then dropped). Returns each
    tensor's dtype and shape, for comparing readers."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        return copy_live((name, tensor.clone()) for name, tensor in streamer.get_tensors())


def copy_live(tensors: Any) -> dict[str, str]:
    """What a vLLM rank does with each tensor the relay's reader yields: each is already a tensor
    of its own (read from node memory straight into it, in place of the clone), copied into its
    parameter as above. The same work per tensor as vLLM does either way, so readers compare."""
    import torch
    from support import relaychild

    out = {}
    for name, tensor in tensors:
        param = torch.empty_like(tensor)
        param.copy_(tensor)
        out[name] = f"{tensor.dtype}:{tuple(tensor.shape)}"
        del param
        relaychild._trace(name)  # the first-tensor time, as relaychild's own loads record it
    return out


def _flock(path: Path, deadline: float) -> tuple[int, bool]:
    """An exclusive lock on *path*: (fd, True) when had at once (this reader copies), (fd, False)
    after waiting for the holder; TimeoutError at *deadline*. As Ray's FileLock(timeout=0), then -1."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    first = True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, first
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
        first = False
        if time.monotonic() > deadline:
            os.close(fd)
            raise TimeoutError(f"waited for the copy lock {path} until the deadline")
        time.sleep(0.05)


def ray_copy(args: dict[str, Any], load) -> dict[str, Any]:
    """Ray 2.48's node copy, then the streamer on the local files."""
    import pyarrow.fs as pa_fs

    from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

    t0 = time.monotonic()
    dest = Path(args["copy_dir"])
    done = dest / ".complete"
    fd, first = _flock(dest.parent / f"{dest.name}.lock", time.monotonic() + float(args["deadline_s"]))
    copied = 0
    try:
        if first and not done.exists():
            fs = endpoint_s3_filesystem(False, args["endpoint"])
            prefix = args["uri"].split("://", 1)[1]
            dest.mkdir(parents=True, exist_ok=True)
            for info in fs.get_file_info(pa_fs.FileSelector(prefix, recursive=True)):
                if info.type != pa_fs.FileType.File:
                    continue
                rel = info.path[len(prefix):].lstrip("/")
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                with fs.open_input_file(info.path) as src, open(dest / rel, "wb") as out:
                    data = src.read()  # whole object in memory, as Ray does
                    out.write(data)
                    copied += len(data)
                    del data
            done.write_text(str(copied))
    finally:
        os.close(fd)  # drops the lock
    if not done.exists():
        raise RuntimeError(f"the reader holding the copy lock left no complete copy in {dest}")
    copy_s = time.monotonic() - t0
    tensors = load([str(dest / k) for k in args["weights"]])
    return {"tensors": tensors, "ready_s": time.monotonic() - t0, "copied": first, "copy_s": copy_s,
            "copied_bytes": copied}


def child_main(args: dict[str, Any]) -> None:
    """One reader: import everything, say ARMED, wait for the go line on stdin, load, write JSON."""
    import runai_model_streamer  # noqa: F401
    import torch  # noqa: F401
    from support import relaychild

    from ray_runai_shim.integrations.reader_count import readers_on_node, relay_wanted
    from ray_runai_shim.snapshot import relay  # noqa: F401

    # --verify: relaychild's per-tensor sha256; else a copy per tensor (as vLLM copies it into its
    # parameter), for streamed and live tensors alike. relaychild.main loads with these.
    load = relaychild.stream_tensors if args.get("verify") else copy_tensors
    relaychild.stream_tensors = load
    if not args.get("verify"):  # the pipelined reader does what the streaming one does per tensor
        relaychild.live_tensors = copy_live
    result_path = Path(args["result"])
    print(ARMED, flush=True)
    ready, _, _ = select.select([sys.stdin], [], [], ARM_TIMEOUT_S + float(args["deadline_s"]))
    if not ready or not sys.stdin.readline().strip():
        raise SystemExit("no go from the parent")
    t_go = time.time()
    method = args["method"]
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        if method == "ray-copy":
            out.update(ray_copy(args, load))
        else:
            mode = method
            if method == "auto":  # the shim's own decision for this many readers on the node
                engine = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
                mode = "relay" if relay_wanted(readers_on_node(engine)) else "stream"  # NODE_ENGINES = N
                out["auto_relays"] = mode == "relay"
            if method in ("relay-budget", "relay-wait"):
                mode = "relay"  # the env carries the user's budget; relay-wait: the whole copy first
            # the shim's own memory rule, as the engine's process applies it where the user set no limit
            rule = {"budget": args["readers"]} if method in ("relay", "auto", "relay-wait") else {}
            out.update(relaychild.main({**args, "mode": mode, "pipelined": method != "relay-wait", **rule}))
        out["ready_at"] = t_go + out["ready_s"]
    except Exception as e:  # one JSON file either way
        out["error"] = f"{type(e).__name__}: {e}"
    out["t_go"] = t_go
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_bytes"] = usage.ru_maxrss * 1024
    out["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)  # the whole process, imports included
    result_path.write_text(json.dumps(out))
    if "error" in out:
        sys.exit(1)


# -- one measurement (N readers, one method) ----------------------------------------------------

def child_env(base: dict[str, str], store_env: dict[str, str], endpoint: str, relay_dir: Path, method: str,
              readers: int, request_timeout_ms: Optional[int], budget_mib: int = DEFAULT_BUDGET_MIB) -> dict[str, str]:
    """A reader's environment: the store through the proxy, its own relay dir, the method's mode."""
    env = {k: v for k, v in base.items() if not k.startswith(_ENV_DROP_PREFIXES)}
    env.update(store_env)
    env.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
                "RAY_RUNAI_SHIM_RELAY_DIR": str(relay_dir),
                "RAY_RUNAI_SHIM_RELAY": {"relay": "on", "relay-wait": "on", "relay-budget": "on",
                                          "auto": "auto"}.get(method, "off"),
                "RAY_RUNAI_SHIM_NODE_ENGINES": str(readers),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH")) if p)})
    if request_timeout_ms:
        env[REQUEST_TIMEOUT_ENV] = str(request_timeout_ms)
    if method == "relay-budget":
        env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(budget_mib * MIB)
    return env


def _wait_armed(procs: list[subprocess.Popen], deadline: float) -> None:
    """Until every reader printed ARMED (each has imported everything); bounded by *deadline*."""
    pending = {p.stdout.fileno(): (p, b"") for p in procs}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(pending)} reader(s) not armed within {ARM_TIMEOUT_S:.0f} s")
        ready, _, _ = select.select(list(pending), [], [], min(left, 1.0))
        for fd in ready:
            p, buf = pending[fd]
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"reader {p.pid} exited before it was armed (rc={p.wait(timeout=5)})")
            buf += chunk
            if ARMED.encode() in buf:
                del pending[fd]
            else:
                pending[fd] = (p, buf)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def measure(method: str, n: int, rate: float, model: dict[str, Any], proxy: Any, store_env: dict[str, str],
            workdir: Path, request_timeout_ms: Optional[int], verify: bool,
            budget_mib: int = DEFAULT_BUDGET_MIB) -> dict[str, Any]:
    """N readers of *method* started together; the row for the tables."""
    row: dict[str, Any] = {"rate_mbps": rate, "n": n, "method": method}
    deadline_s = run_timeout(n, model["weight_bytes"], rate)
    relay_dir = Path(tempfile.mkdtemp(prefix="rrs-bench-nodes-", dir="/dev/shm"))
    scratch = Path(tempfile.mkdtemp(prefix=f"{method}-n{n}-", dir=workdir))
    copy_dir = scratch / "ray-copy" / "model"
    copy_dir.parent.mkdir(parents=True)
    env = child_env(dict(os.environ), store_env, proxy.endpoint, relay_dir, method, n, request_timeout_ms, budget_mib)
    procs: list[subprocess.Popen] = []
    sampler: Optional[MemSampler] = None
    try:
        for i in range(n):
            payload = {"uri": model["uri"], "endpoint": proxy.endpoint, "weights": model["weights"],
                       "method": method, "readers": n, "copy_dir": str(copy_dir), "deadline_s": deadline_s,
                       "verify": verify, "result": str(scratch / f"reader-{i}.json")}
            with open(scratch / f"reader-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(payload)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        _wait_armed(procs, time.monotonic() + ARM_TIMEOUT_S)
        proxy.reset()
        sampler = MemSampler(tuple(p.pid for p in procs), relay_dir).start()
        t0 = time.time()
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.close()
        end = time.monotonic() + deadline_s
        for p in procs:
            try:
                p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{method} N={n}: readers not done within {deadline_s:.0f} s") from None
        row["peak_mem_bytes"] = sampler.stop()
        row["own_mem_bytes"] = sampler.own_peak
        results = []
        for i, p in enumerate(procs):
            f = scratch / f"reader-{i}.json"
            r = json.loads(f.read_text()) if f.is_file() else {"error": f"no result (rc={p.returncode})"}
            if "error" in r:
                tail = (scratch / f"reader-{i}.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"reader {i}: {r['error']}\n{tail}")
            results.append(r)
        weights = proxy.body_bytes(".safetensors")
        row.update(
            wall_s=max(r["ready_at"] for r in results) - t0,
            ready_s=[round(r["ready_s"], 3) for r in results],
            store_bytes=weights, store_x=weights / model["weight_bytes"], link_bytes=proxy.downstream,
            disk_bytes=dir_bytes(copy_dir), relay_left_bytes=dir_bytes(relay_dir),
            fetchers=sum(1 for r in results if r.get("fetched") or r.get("copied")),
            reader_peak_rss_bytes=[r["peak_rss_bytes"] for r in results],
            reader_cpu_s=[r.get("cpu_s") for r in results],
            tensors=results[0]["tensors"], same_tensors=all(r["tensors"] == results[0]["tensors"] for r in results),
            first_tensor_s=[_round(r.get("first_tensor_s")) for r in results],
            follower_first_s=max((r["first_tensor_s"] for r in results if not (r.get("fetched") or r.get("copied"))
                                  and r.get("first_tensor_s") is not None), default=None),
            copy_s=next((r["copy_s"] for r in results if r.get("fetched") and r.get("copy_s")), None))
        if method == "auto":
            row["auto_relays"] = results[0].get("auto_relays")
    except Exception as e:
        if sampler is not None:
            sampler.stop()
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        _kill(procs)
        shutil.rmtree(relay_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return row


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def describe(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  N={row['n']} {row['method']:<8} FAILED: {row['error'].strip().splitlines()[0][:200]}"
    return (f"  N={row['n']} {method_cell(row):<15} wall {row['wall_s']:7.2f}s  store {row['store_x']:.2f} x S  "
            f"peak node mem {_mib(row['peak_mem_bytes'])} (readers + copy {_mib(row['own_mem_bytes'])})  "
            f"disk {_mib(row['disk_bytes'])}  "
            f"ready {row['ready_s']}  first tensor {row['first_tensor_s']}  copy {_secs(row.get('copy_s'))}")



def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="weight GiB of the model (default 1)")
    ap.add_argument("--ns", type=parse_ns, default=[1, 2, 4], help="readers on the node (default 1,2,4)")
    ap.add_argument("--rates", "--rate-mbps", dest="rates", type=parse_rates, default=[40.0, 0.0],
                    help="MB/s of the link to the store, one table each; 0 = unlimited (default 40,0)")
    ap.add_argument("--methods", type=parse_methods, default=list(METHODS),
                    help=f"some of {','.join(METHODS)} (default all; auto runs at N = 1 only)")
    ap.add_argument("--request-timeout-ms", type=int, default=None,
                    help=f"set {REQUEST_TIMEOUT_ENV} for every reader (default: the streamer's own)")
    ap.add_argument("--budget-mib", type=int, default=DEFAULT_BUDGET_MIB,
                    help=f"the per-reader streamer budget of relay-budget (default {DEFAULT_BUDGET_MIB})")
    ap.add_argument("--layouts", type=parse_ns, default=[1, 8],
                    help="the checkpoint as this many shards, one model each (default 1,8: one file, 8 shards)")
    ap.add_argument("--verify", action="store_true", help="sha256 every tensor in every reader (slower)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the temp data goes (default: system tmp)")
    ap.add_argument("--docs", type=Path, metavar="PATH",
                    help="rewrite the bench-nodes block of this page (docs/ means docs/benchmarks.md)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.size_gib <= 0:
        ap.error("--size-gib must be positive")
    doc = bench_docs.page(args.docs, PAGE) if args.docs else None
    if doc is not None and not bench_docs.has_block(doc, BEGIN, END):  # say so now, not after the run
        ap.error(f"{doc} needs exactly one {BEGIN} ... {END} block")
    size = int(args.size_gib * GIB)
    need = 2.2 * size + 512 * MIB  # the server's copy, one Ray copy at a time, slack
    free = shutil.disk_usage(args.tmp).free
    if free < need:
        print(f"not enough space in {args.tmp}: need ~{need / GIB:.1f} GiB, have {free / GIB:.1f} GiB")
        return 2
    if shutil.disk_usage("/dev/shm").free < 1.2 * size:
        print(f"/dev/shm cannot hold one {args.size_gib:g} GiB relay copy")
        return 2

    signal.signal(signal.SIGTERM, raise_on_signal)
    signal.signal(signal.SIGHUP, raise_on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="ray-runai-bench-nodes-", dir=args.tmp))
    server: Optional[S3rver] = None
    rows: list[dict[str, Any]] = []
    try:
        server = S3rver(ensure_s3rver(), workdir / "s3rver-data", workdir / "s3rver.log")
        server.start()
        client = s3_client(server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        noise = make_noise(min(64 * MIB, size))
        for shards in args.layouts:
            prefix = f"models/nodes-{args.size_gib:g}gib-{shards}"
            model = build_model(workdir / "src" / prefix, size, noise, shard_max_bytes=-(-size // shards))
            model["upload_s"] = upload_dir(client, workdir / "src" / prefix, prefix)
            model.update(uri=f"s3://{BUCKET}/{prefix}", size_gib=args.size_gib,
                         weights=sorted(k for k in model["files"] if k.endswith(".safetensors")))
            print(f"{model['uri']}: {model['shards']} shard(s), S = {model['weight_bytes']:,} weight bytes", flush=True)
            reference: Optional[dict[str, str]] = None
            for rate in args.rates:
                print(f"link {rate_label(rate)}:", flush=True)
                with CountingProxy(server.port, rate=rate * 1e6 if rate else None) as proxy:
                    for n, method in plan(args.ns, args.methods):
                        row = measure(method, n, rate, model, proxy, server.env(), workdir, args.request_timeout_ms,
                                      args.verify, args.budget_mib)
                        row["shards"] = model["shards"]
                        tensors = row.pop("tensors", None)
                        if tensors is not None:
                            reference = reference or tensors
                            row["exact"] = bool(row.pop("same_tensors")) and tensors == reference
                        rows.append(row)
                        print(describe(row), flush=True)
        data = {"command": [sys.executable, *sys.argv], "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "env": env_info(), "model": {k: v for k, v in model.items() if k != "files"},
                "request_timeout_ms": args.request_timeout_ms, "budget_mib": args.budget_mib,
                "streamer_env": {k: v for k, v in os.environ.items() if k.startswith("RUNAI_STREAMER")},
                "verify": args.verify, "runs": rows,
                "ratios": {f"{shards}x{rate:g}": ratios([r for r in rows if r.get("shards") == shards], rate)
                           for shards in dict.fromkeys(r.get("shards") for r in rows) for rate in args.rates}}
        print()
        print(tables(data))
        write_results(RESULTS_JSON, data, doc, BEGIN, END, readme_block(data) if doc is not None else "")
        return 1 if any("error" in r for r in rows) else 0
    finally:
        stop_and_clean(server, workdir)


if __name__ == "__main__":
    sys.exit(main())
