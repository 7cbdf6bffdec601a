"""bench part: the printed tables, ratios and trends, and the environment recorded in the JSON."""

from __future__ import annotations

import os
import platform
from typing import Any

from bench_models import MIB
from bench_servers import S3RVER_VERSION


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


def env_info() -> dict[str, Any]:
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
