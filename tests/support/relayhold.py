"""A reader that holds a node relay copy, in a process of its own, without loading it.

``python relayhold.py '<json>'`` with ``uri``, ``endpoint`` and ``then``:

* ``hold``: print the copy, then sleep until killed (a reader the OOM killer or ``ray.kill``
  will end with SIGKILL);
* ``fork`` / ``spawn``: start a child the way vLLM starts its engine core and workers (a bare
  ``os.fork`` as on GPUs, or multiprocessing's ``spawn`` as the CPU build forces), release the
  copy while the child still runs, print whether the release freed it and the child's pid,
  then wait for the child (the test ends it). ``inherit_locks`` false shows the fork without
  the shim's at-fork rule.

Prints one JSON line per step; no torch, no streamer: the tests here are about the hold.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def main(args: dict) -> None:
    from ray_runai_shim.snapshot import locks, relay
    from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

    def fs_and_path(uri: str):
        return endpoint_s3_filesystem(False, args["endpoint"]), uri.split("://", 1)[1]

    got = relay.acquire(args["uri"], fs_and_path)
    print(json.dumps({"path": str(got.path) if got else None, "pid": os.getpid()}), flush=True)
    if args["then"] == "hold":
        time.sleep(3600)
    if args.get("inherit_locks"):
        locks.CLOSE_IN_CHILD = False
    if args["then"] == "fork":
        child = os.fork()
        if child == 0:  # an engine core: lives on after the reader's load is done
            time.sleep(120)
            os._exit(0)
        pid = child
    else:
        proc = multiprocessing.get_context("spawn").Process(target=_sleep, args=(120,))
        proc.start()
        pid = proc.pid
    time.sleep(0.5)  # the reader's own load; its child is long past its start by then
    freed = relay.release(got)
    print(json.dumps({"freed": freed, "child": pid, "exists": got.path.exists()}), flush=True)
    os.waitpid(pid, 0) if args["then"] == "fork" else proc.join()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
