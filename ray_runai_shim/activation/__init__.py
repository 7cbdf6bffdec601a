"""Activation: how the shim gets into every process that needs it.

``bootstrap`` waits (stdlib only) for ``import ray``; ``ray_init`` carries the shim
into a job's workers through ``ray.init``'s runtime_env; ``jobenv`` merges that
runtime_env with what a job submission already set; ``serve_config`` covers Serve
apps deployed from config files. Nothing here imports Ray, vLLM or wrapt at import.
"""

from __future__ import annotations


def worker_setup() -> None:
    """The job-level ``worker_process_setup_hook`` (its public name, kept stable:
    ``ray_runai_shim.activation.worker_setup``); the work is in :mod:`.ray_init`."""
    from .ray_init import worker_setup as _worker_setup

    _worker_setup()
