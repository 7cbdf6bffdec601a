"""Run Python snippets in fresh interpreters, the only honest way to test import order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"


def base_env(extra: Optional[dict[str, str]] = None, *, site: bool = True) -> dict[str, str]:
    """The caller's environment minus shim switches, plus the test site dir on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_RUNAI_SHIM")}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONWARNINGS"] = "ignore"
    if site:
        parts = [str(SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra or {})
    return env


# Ray picks its runtime-env agent port by binding and releasing it; another process can
# take it before the agent binds (seen once in CI: a Prometheus exporter answered the
# raylet's POST). That is Ray's port race, not the code under test: run once more.
RAY_PORT_RACE = "HTTP request returns non-ok status code 405"


def ray_port_race(proc: subprocess.CompletedProcess) -> bool:
    """Whether *proc* failed because a foreign server held Ray's runtime-env agent port."""
    return proc.returncode != 0 and RAY_PORT_RACE in (proc.stderr or "") + (proc.stdout or "")


def run_python(
    code: str,
    env: Optional[dict[str, str]] = None,
    timeout: float = 300,
    cwd: Optional[Path] = None,
    check: bool = True,
    args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run *code* in a new interpreter; fail with its output if it exits non-zero.

    A run lost to Ray's own port race (:data:`RAY_PORT_RACE`) is repeated once.
    """
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            env=env if env is not None else base_env(),
            cwd=str(cwd or REPO),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if attempt == 1 and ray_port_race(proc):
            print(f"Ray's port race ({RAY_PORT_RACE!r}); running the snippet once more", file=sys.stderr)
            continue
        break
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def last_json(proc: subprocess.CompletedProcess) -> Any:
    """The last stdout line that parses as JSON (snippets print their verdict last)."""
    for line in reversed(proc.stdout.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
