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
