"""The layered import contract (``.importlinter``) is kept, and it does fail on a back-import:
the same check, run on a copy of the package where one low module imports a high one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), "--no-cache", str(ROOT / ".importlinter")], capture_output=True, text=True,
                          env=env, cwd=package_parent, timeout=120)


def test_the_package_keeps_its_layers(tmp_path):
    shutil.copytree(ROOT / "ray_runai_shim", tmp_path / "ray_runai_shim")
    kept = lint(tmp_path)
    assert kept.returncode == 0 and "1 kept, 0 broken" in kept.stdout, kept.stdout[-2000:]

    # Control: one back-import (the memory reading importing the vLLM hook above it) breaks it.
    memory = tmp_path / "ray_runai_shim" / "snapshot" / "memory.py"
    memory.write_text(memory.read_text() + "\n\ndef _back():\n    from ..integrations import engine_relay  # noqa\n")
    broken = lint(tmp_path)
    assert broken.returncode != 0 and "0 kept, 1 broken" in broken.stdout
    assert "ray_runai_shim.snapshot is not allowed to import ray_runai_shim.integrations" in broken.stdout
    assert "ray_runai_shim.snapshot.memory -> ray_runai_shim.integrations.engine_relay" in broken.stdout
