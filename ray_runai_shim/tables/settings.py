"""Every environment variable the shim reads or sets, named in one place; its own parsed here.

Stdlib only (the bootstrap reads the kill switch before anything else is
imported). A bad value never raises inside Ray: it is reported once, as a
WARNING naming the variable, the value and what was used instead, and the
default applies.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional

DISABLE = "RAY_RUNAI_SHIM_DISABLE"
AUTOLOAD = "RAY_RUNAI_SHIM_AUTOLOAD"
#: Set by an engine's process for its vLLM children: install the Ray-free patches at start.
RELAY_READERS = "RAY_RUNAI_SHIM_RELAY_READERS"
#: The file the wheel puts into site-packages: with AUTOLOAD=1, every interpreter loads the shim.
AUTOLOAD_PTH = "ray_runai_shim_autoload.pth"
CACHE_DIR = "RAY_RUNAI_SHIM_CACHE_DIR"
LOCK_TIMEOUT = "RAY_RUNAI_SHIM_LOCK_TIMEOUT"
HANDOFF = "RAY_RUNAI_SHIM_HANDOFF"
RELAY = "RAY_RUNAI_SHIM_RELAY"  # auto | on | off: the node relay (one store read per node)
RELAY_DIR = "RAY_RUNAI_SHIM_RELAY_DIR"  # where relay copies live (default: /dev/shm)
CLUSTER_RELAY = "RAY_RUNAI_SHIM_CLUSTER_RELAY"  # auto | off: node relays take the weights from each other
RELAY_KEEP = "RAY_RUNAI_SHIM_RELAY_KEEP"  # bytes a copy may keep after the last load (default 0)
RELAY_WAIT = "RAY_RUNAI_SHIM_RELAY_WAIT"  # how long a copy waits for the node's late readers (default 120 s)
NODE_ENGINES = "RAY_RUNAI_SHIM_NODE_ENGINES"  # engines of one model planned per node (default: 1)
CHAINED_SETUP_HOOK = "RAY_RUNAI_SHIM_CHAINED_SETUP_HOOK"  # the user's own worker setup hook, run after ours

# Ray's, read or set by the shim (never its private switches: those stay Ray's).
RAY_ADDRESS = "RAY_ADDRESS"
RAY_OVERRIDE_JOB_RUNTIME_ENV = "RAY_OVERRIDE_JOB_RUNTIME_ENV"
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # a submitted job's runtime_env, as Ray hands it to the driver
RAY_WORKER_SETUP_HOOK = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # where Ray exports a string setup hook

# The Run:ai streamer's, set where the user has not (vLLM's engine process; its ranks inherit them).
STREAMER_MEMORY_LIMIT = "RUNAI_STREAMER_MEMORY_LIMIT"
STREAMER_REQUEST_TIMEOUT = "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"
STREAMER_UNSIGNED = "RUNAI_STREAMER_S3_UNSIGNED"  # the streamer's spelling of Ray's s3://anonymous@
STREAMER_VIRTUAL_ADDRESSING = "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_warned: set[tuple[str, str]] = set()


def _bad(name: str, value: str, expected: str, used: object) -> None:
    if (name, value) in _warned:
        return
    _warned.add((name, value))
    logging.getLogger("ray.runai_shim").warning(
        "ray-runai-shim: ignoring %s=%r (expected %s); using %s", name, value, expected, used
    )


def flag(name: str, default: bool = False) -> bool:
    """On/off: ``1/true/yes/on`` or ``0/false/no/off`` (any case); unset is *default*."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False if value else default
    _bad(name, raw, "1/0, true/false, yes/no or on/off", "on" if default else "off")
    return default


def seconds(name: str, default: float) -> float:
    """A duration: ``1800``, ``90s``, ``30m``, ``1.5h``; must be > 0."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", raw.lower())
    if m and float(m.group(1)) > 0:
        return float(m.group(1)) * _UNITS[m.group(2)]
    _bad(name, raw, "a positive number of seconds, or e.g. 90s, 30m, 1h", f"{default:g} s")
    return default


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in choices:
        return value
    _bad(name, raw, " or ".join(choices), default)
    return default


def count(name: str, default: int, low: int = 0) -> int:
    """A whole number >= *low* (bytes, engines); unset or empty is *default*."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = low - 1
    if value >= low:
        return value
    _bad(name, raw, f"a whole number >= {low}", default)
    return default


def path(name: str) -> Optional[Path]:
    raw = os.environ.get(name, "").strip()
    return Path(raw).expanduser() if raw else None


def disabled() -> bool:
    """The kill switch ``RAY_RUNAI_SHIM_DISABLE``."""
    return flag(DISABLE)
