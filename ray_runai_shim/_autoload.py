"""Interpreter-start activation for ``runtime_env={"pip": ["ray-runai-shim"]}``.

The wheel ships ``ray_runai_shim_autoload.pth``, which imports this module only when
``RAY_RUNAI_SHIM_AUTOLOAD=1``. Importing the package leaves the stdlib-only
watcher; nothing heavier runs until Ray is imported. The variable is removed
from this process's environment so processes it starts (vLLM's engine core,
compile workers) do not activate again.
"""

import os

os.environ.pop("RAY_RUNAI_SHIM_AUTOLOAD", None)

import ray_runai_shim  # noqa: E402,F401
