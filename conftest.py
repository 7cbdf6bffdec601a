"""Top-level pytest configuration: make ``tests/support`` importable as ``support``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "tests"))

pytest_plugins = ["support.fixtures"]
