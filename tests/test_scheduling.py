"""The plugin that spreads ``./dev test`` over its workers (``support/scheduling.py``): a real
two-worker run of two files of one unit lands on one worker; a real one-worker run starts with the
file that has an engine test; the shared units name real files."""

from __future__ import annotations

import re
import subprocess
import sys

from support import scheduling
from support.procs import REPO, base_env


def test_every_shared_unit_names_a_real_file():
    for path in scheduling.SHARED_UNITS:
        assert (REPO / path).is_file(), path


def run_pytest(root, workers: int) -> str:
    """A real ``pytest -n <workers> --dist loadfile -v`` of *root*'s ``tests/*_test.py``; its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadfile", "-v", "-p", "no:cacheprovider",
         "-o", "python_files=*_test.py", "tests"],
        cwd=str(root), env=base_env({}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


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
    stdout = run_pytest(root, workers=2)
    workers = {}
    for m in re.finditer(r"\[(gw\d)\][^\n]*?PASSED (tests/\w+\.py)", stdout):
        workers.setdefault(m.group(2), set()).add(m.group(1))
    assert set(workers) == {A, B, C}, stdout[-3000:]
    return workers


def test_files_of_one_unit_run_on_one_worker(tmp_path):
    workers = workers_of(tmp_path, plugin=True)
    assert workers[A] == workers[B] and len(workers[A]) == 1, workers  # one unit, one worker
    control = workers_of(tmp_path, plugin=False)  # xdist alone hands the two files to both workers
    assert control[A] != control[B], control


def first_file_run(tmp_path, plugin: bool) -> str:
    """The file whose test a one-worker run passes first: two plain files, then one with an engine test."""
    root = tmp_path / ("order-with" if plugin else "order-without")
    (root / "tests").mkdir(parents=True)
    for name in ("tests/a_test.py", "tests/b_test.py"):
        (root / name).write_text("def test_plain():\n    pass\n")
    (root / "tests/z_test.py").write_text("import pytest\n\n\n@pytest.mark.engine\ndef test_engine():\n    pass\n")
    conftest = 'def pytest_configure(config):\n    config.addinivalue_line("markers", "engine: x")\n'
    if plugin:
        conftest += (f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                     "pytest_plugins = ['support.scheduling']\n")
    (root / "conftest.py").write_text(conftest)
    stdout = run_pytest(root, workers=1)
    m = re.search(r"PASSED (tests/\w+\.py)", stdout)
    assert m, stdout[-3000:]
    return m.group(1)


def test_the_files_with_engine_tests_go_first(tmp_path):
    assert first_file_run(tmp_path, plugin=True) == "tests/z_test.py"
    assert first_file_run(tmp_path, plugin=False) == "tests/a_test.py"  # xdist alone: collection order
