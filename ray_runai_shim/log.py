"""The shim's logger.

It is a child of Ray's ``ray`` logger so that its lines appear wherever Ray's
own lines do (driver console, actor logs) without the shim adding handlers.
Silence it with ``logging.getLogger("ray.runai_shim").setLevel(logging.WARNING)``.
"""

import logging

logger = logging.getLogger("ray.runai_shim")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def log_handoff(model: str, load_format: str, local_dir: str, how: str, stats: dict) -> None:
    """The one INFO line per engine: where config came from, where the weights stream from."""
    if stats:
        fetched = (
            f"reused {stats['nonweight_files']} non-weight files"
            if stats["reused"]
            else f"fetched {stats['fetched_files']} non-weight files ({human_bytes(stats['fetched_bytes'])})"
        )
        logger.info(
            "ray-runai-shim: %s in %.2f s to %s; skipped %d weight files (%s); "
            "vLLM streams weights from %s with load_format=%s (%s)",
            fetched, stats["seconds"], local_dir, stats["weight_files"], human_bytes(stats["weight_bytes"]),
            model, load_format, how,
        )
    else:
        logger.info(
            "ray-runai-shim: vLLM reads config/tokenizer from %s and streams weights from %s "
            "with load_format=%s (%s)",
            local_dir, model, load_format, how,
        )
