"""The plugin that spreads ``./dev test`` over its workers (``support/scheduling.py``): a real
two-worker run of two files of one unit lands on one worker; the shared units name real files."""

from __future__ import annotations

import re
import subprocess
import sys

from support import scheduling
from support.procs import REPO, base_env


def test_every_shared_unit_names_a_real_file():
    for path in scheduling.SHARED_UNITS:
        assert (REPO / path).is_file(), path


A, B, C = "tests/unit_a_test.py", "tests/unit_b_test.py", "tests/unit_c_test.py"


def workers_of(tmp_path, plugin: bool) -> dict:
    """Which worker ran each of three files, A and B declared one unit (with the plugin)."""
    root = tmp_path / ("with" if plugin else "without")
    (root / "tests").mkdir(parents=True)
    for name in (A, B, C):
        (root / name).write_text("".join(f"def test_{i}():\n    pass\n" for i in range(4)))
    if plugin:
        (root / "conftest.py").write_text(
            f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "from support import scheduling\n"
            f"scheduling.SHARED_UNITS.update({{{A!r}: 'u', {B!r}: 'u'}})\n"
            "pytest_plugins = ['support.scheduling']\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-v", "-p", "no:cacheprovider",
         "-o", "python_files=*_test.py", "tests"],
        cwd=str(root), env=base_env({}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    workers = {}
    for m in re.finditer(r"\[(gw\d)\][^\n]*?PASSED (tests/\w+\.py)", proc.stdout):
        workers.setdefault(m.group(2), set()).add(m.group(1))
    assert set(workers) == {A, B, C}, proc.stdout[-3000:]
    return workers


def test_files_of_one_unit_run_on_one_worker(tmp_path):
    workers = workers_of(tmp_path, plugin=True)
    assert workers[A] == workers[B] and len(workers[A]) == 1, workers  # one unit, one worker
    control = workers_of(tmp_path, plugin=False)  # xdist alone hands the two files to both workers
    assert control[A] != control[B], control
