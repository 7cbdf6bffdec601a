"""Which kind of process this is: a job's driver, a Ray worker, or one of Ray's own daemons.

Asked to decide who speaks (the driver says the one INFO line; workers and daemons stay at
DEBUG) and whether ``ray.init`` was already called for us. Stdlib only at import; the
questions are asked only once Ray itself is loaded.
"""

from __future__ import annotations

import os
import sys


def in_ray_worker() -> bool:
    try:
        import ray._private.worker as w

        return w.global_worker.mode == w.WORKER_MODE
    except Exception:
        return False


def in_ray_system_process() -> bool:
    """Ray's own processes (dashboard, agents, log monitor, default_worker) run scripts from
    inside Ray's package, and the ``ray`` CLI starts them; a driver runs the user's script,
    ``-c``, or ``serve run``."""
    ray = sys.modules.get("ray")
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    if os.path.basename(script) == "ray":  # the CLI (`ray start`, `ray job submit`): not a job's driver
        return True
    if ray is None or not script or not getattr(ray, "__file__", None):
        return False
    package = os.path.dirname(os.path.realpath(ray.__file__))
    return os.path.realpath(script).startswith(package + os.sep)
