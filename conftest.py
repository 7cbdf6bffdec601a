"""Top-level pytest configuration: make ``tests/support`` importable as ``support``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "tests"))

pytest_plugins = ["support.fixtures", "support.scheduling"]

# tests/matrix runs inside the per-release envs that noxfile.py builds, never in the default run.
if not __import__("os").environ.get("RAY_RUNAI_SHIM_MATRIX"):
    collect_ignore = ["tests/matrix"]

