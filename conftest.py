"""Top-level pytest configuration: make ``tests/support`` importable as ``support``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "tests"))

pytest_plugins = ["support.fixtures"]

# tests/matrix runs inside the per-release envs that noxfile.py builds, never in the default run.
if not __import__("os").environ.get("RAY_RUNAI_SHIM_MATRIX"):
    collect_ignore = ["tests/matrix"]


#: Files whose tests start Ray Serve: never two at once (./dev test runs two workers), since a
#: Serve proxy that starts beside another one on this 2-core box misses its readiness check.
SERVE_FILES = ("tests/integrations/test_serve.py", "tests/activation/test_deploy.py")


def pytest_collection_modifyitems(config, items):
    """With ``--dist loadgroup``: a test file stays in one worker (its module fixtures run
    once), and the files that start Serve share one group."""
    import pytest

    root = Path(__file__).parent
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        item.add_marker(pytest.mark.xdist_group("serve" if rel in SERVE_FILES else rel))
