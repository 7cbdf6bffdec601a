"""Helpers every bench scenario shares: the cleanup-on-signal handler and side-by-side ratios."""

from __future__ import annotations

from typing import Any, Optional


def raise_on_signal(signum: int, _frame: Any) -> None:
    """Install for SIGTERM/SIGHUP so a bench's ``finally`` cleanup (servers, temp dirs) runs."""
    raise SystemExit(128 + signum)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """*a* / *b*, or None when either side is missing (a failed run is never a ratio)."""
    return None if a is None or not b else a / b
