"""Interpreter-start activation for images and ``runtime_env={"pip": ["ray-runai-shim"]}``.

The wheel ships ``ray_runai_shim_autoload.pth``, which imports this module only when
``RAY_RUNAI_SHIM_AUTOLOAD=1``. Importing the package leaves the stdlib-only
watcher; nothing heavier runs until Ray is imported. The variable stays in the
environment on purpose: on an image, ``ray start`` is the first process that sees it,
and Ray's daemons, workers and Serve replicas inherit it from there.
"""

import os

import ray_runai_shim  # noqa: F401
from ray_runai_shim.activation import bootstrap
from ray_runai_shim.tables import settings

if os.environ.get(settings.RELAY_READERS) == "1":
    # vLLM's engine core and workers of an engine that relays (they never import Ray): the
    # Ray-free patch that lets each rank read the relay's copy as it lands (#36), in place now.
    bootstrap.activate(now=True)
