"""bench part: the cold-start tables -- medians per method, the ratios, and the block in docs/benchmarks.md."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from bench_common import ratio
from bench_models import MIB

BEGIN = "<!-- bench-coldstart:begin -->"
END = "<!-- bench-coldstart:end -->"
#: The docs page that holds the block (``--docs docs/`` means this file in that folder).
PAGE = "benchmarks.md"
#: What each method is, for the tables.
LABELS = {
    "ray-alone": "Ray 2.48 alone (full copy, vLLM loads the copy)",
    "shim": "Ray 2.48 + ray-runai-shim (streams)",
    "native": "Ray 2.60 + vLLM 0.29, native (streams)",
}
METRICS = ("first_output_s", "download_s", "load_s", "weight_bytes_written", "actor_peak_rss_mib",
           "engine_peak_rss_mib", "store_bytes")


def _median(values: list[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: the median of every metric over its runs, and the run count."""
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        out[method] = {m: _median([r.get(m) for r in mine]) for m in METRICS}
        out[method]["runs"] = len(mine)
        out[method]["ray"] = mine[0]["ray"]
    return out



def ratios(med: dict[str, dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """shim/ray-alone and shim/native for every metric both sides have."""
    out: dict[str, dict[str, Optional[float]]] = {}
    for other in ("ray-alone", "native"):
        if "shim" in med and other in med:
            out[f"shim/{other}"] = {m: ratio(med["shim"][m], med[other][m]) for m in METRICS}
    return out


def _fmt(value: Any, metric: str) -> str:
    if value is None:
        return "n/a"
    if metric in ("weight_bytes_written", "store_bytes"):
        return f"{value / MIB:,.0f} MiB" if value else "0"
    if metric.endswith("_mib"):
        return f"{value:,.0f} MiB"
    return f"{value:.2f} s"


def _fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def tables(data: dict[str, Any]) -> str:
    """Markdown tables: the cold start per method with ratios, N engines, streamer settings."""
    med = data["medians"]
    rat = data["ratios"]
    heads = ["time to first output", "download phase", "vLLM weight load", "weight bytes written",
             "stage actor peak RSS", "vLLM loading process peak RSS", "bytes read from the store"]
    cols = [m for m in ("ray-alone", "shim", "native") if m in med]
    lines = ["| metric | " + " | ".join(f"{LABELS[c]} ({med[c]['runs']} runs, median)" for c in cols)
             + " | " + " | ".join(rat) + " |",
             "|---" * (1 + len(cols) + len(rat)) + "|"]
    for metric, head in zip(METRICS, heads):
        lines.append(f"| {head} | " + " | ".join(_fmt(med[c][metric], metric) for c in cols) + " | "
                     + " | ".join(_fmt_ratio(r[metric]) for r in rat.values()) + " |")
    if data.get("multi"):
        lines += ["", "| engines on one node | method | time to last output | bytes read from the store | "
                      "weight bytes written |", "|---|---|---|---|---|"]
        for r in data["multi"]:
            if "error" in r:
                lines.append(f"| {r['engines']} | {r['method']} | failed: {r['error'].splitlines()[-1][:120]} | | |")
                continue
            lines.append(f"| {r['engines']} | {r['method']} | {r['last_output_s']:.1f} s | "
                         f"{_fmt(r['store_bytes'], 'store_bytes')} | "
                         f"{_fmt(r['weight_bytes_written'], 'weight_bytes_written')} |")
    if data.get("settings"):
        lines += ["", "| streamer setting (vLLM's weight iterator, alone) | median seconds | median peak RSS |",
                  "|---|---|---|"]
        for key, rows in settings_groups(data["settings"]).items():
            lines.append(f"| {key} | {_median([r['seconds'] for r in rows]):.2f} s | "
                         f"{_median([r['peak_rss_mib'] for r in rows]):,.0f} MiB |")
    return "\n".join(lines)


def settings_groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = ", ".join(f"{k}={v}" for k, v in sorted(r["settings"].items())) or "defaults"
        groups.setdefault(key, []).append(r)
    return groups


def report(data: dict[str, Any]) -> dict[str, Any]:
    """Print the tables; return the medians and ratios for the JSON."""
    med = medians(data["runs"])
    summary = {"medians": med, "ratios": ratios(med)}
    print()
    print(tables({**data, **summary}))
    return summary


def readme_block(data: dict[str, Any]) -> str:
    """The cold-start block of docs/benchmarks.md (markers included), from one run's JSON."""
    model = data["model"]
    env = data["env"]
    return (
        f"{BEGIN}\n"
        f"Generated by `./dev bench coldstart` on {data['when']} ({env['cpus']} CPUs, {env['platform']}): a "
        f"{model['weight_bytes'] / (1 << 30):.2f} GiB float32 Llama ({model['layers']} layers, {model['shards']} "
        f"shards) on s3rver over loopback, the vLLM CPU engine, each run a fresh driver with its own caches, "
        f"methods alternating.\n\n{tables(data)}\n{END}"
    )
