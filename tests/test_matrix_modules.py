"""The matrix's test modules (``tests/matrix``, run only by ``./dev matrix`` / ``matrix-ci`` in
their own layered envs) still import: a moved helper fails here, in ``./dev test``, not late in
CI's matrix section (that happened once: ``from test_pipeline import ...`` after the layout moved)."""

from __future__ import annotations

import subprocess
import sys

from support.procs import REPO, base_env


def test_every_matrix_test_module_collects():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/matrix"],
        cwd=str(REPO), env=base_env({"RAY_RUNAI_SHIM_MATRIX": "1"}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " collected" in proc.stdout or "tests collected" in proc.stdout, proc.stdout[-2000:]
