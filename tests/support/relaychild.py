"""One reader of a model's weights on this node, in a process of its own.

``python relaychild.py '<json>'`` with ``uri``, ``endpoint`` (the store, or the counting
proxy in front of it), ``mode``: ``relay`` (the node relay, then the real streamer on the
local copy) or ``stream`` (the real streamer straight from the store, as without the relay);
``range`` (relay range bytes), ``hold`` (seconds to keep the copy before release),
``release`` (default true), ``pipelined`` (read a copy in progress as it lands, as the vLLM
ranks do), ``trace`` (a file that gets ``<seconds> <name>`` per tensor as it arrives, and
``@acquire`` when the reader reaches the relay), ``resume``, ``tries`` (tries per range),
``budget`` (the readers on the node: set the streamer's memory budget as the engine's process
does, after the relay's copy is in place), ``readers`` (the readers the node expects: the hold
kept for late ones after release), ``released`` (a file made once this reader has let go).
Prints one JSON line: per-tensor sha256, where the weights came from, whether this process
fetched, timings.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).resolve()


TRACE = {"path": None, "t0": 0.0}


def _trace(name: str) -> None:
    if TRACE.get("first") is None and not name.startswith("@"):
        TRACE["first"] = time.monotonic() - TRACE["t0"]
    if TRACE["path"]:
        with open(TRACE["path"], "a") as f:
            f.write(f"{time.monotonic() - TRACE['t0']:.3f} {name}\n")


def stream_tensors(paths: list[str]) -> dict[str, str]:
    import torch
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        for name, tensor in streamer.get_tensors():
            # the buffer itself, not a copy of it: a reader's memory is what the tests measure
            out[name] = hashlib.sha256(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().data).hexdigest()
            _trace(name)
    return out


def live_tensors(tensors: Any) -> dict[str, str]:
    """Per-tensor sha256 of a copy in progress, read as it lands (vLLM's rank: runai_loader)."""
    import torch

    out = {}
    for name, tensor in tensors:
        out[name] = hashlib.sha256(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().data).hexdigest()
        _trace(name)
    return out


def main(args: dict[str, Any]) -> dict[str, Any]:
    from ray_runai_shim.snapshot import relay, relay_copy, relay_read
    from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

    def fs_and_path(uri: str):
        return endpoint_s3_filesystem(False, args["endpoint"]), uri.split("://", 1)[1]

    if args.get("range"):
        relay_copy.RANGE_BYTES = int(args["range"])
    if args.get("tries"):
        relay_copy.RANGE_TRIES = int(args["tries"])
    if "resume" in args:
        relay_copy.RESUME = bool(args["resume"])
    t0 = time.monotonic()
    TRACE.update(path=args.get("trace"), t0=t0, first=None)
    result: dict[str, Any] = {"pid": os.getpid()}
    if args["mode"] == "relay":
        _trace("@acquire")  # a line for the test, not a tensor: this reader is at the relay's door
        got = relay.acquire(args["uri"], fs_and_path, pipelined=bool(args.get("pipelined")),
                            readers=int(args.get("readers", 1)))
        if got is None:
            result["relay"] = None
            paths = [f"{args['uri']}/{k}" for k in args["weights"]]
        else:
            result.update(relay=str(got.path), fetched=got.fetched, live=got.live)
            paths = [str(got.path / k) for k in args["weights"]]
        if args.get("budget"):
            from ray_runai_shim.integrations.relay_budget import (
                MEMORY_LIMIT,
                REQUEST_TIMEOUT,
                REQUEST_TIMEOUT_MS,
                set_budget,
            )

            os.environ.setdefault(REQUEST_TIMEOUT, REQUEST_TIMEOUT_MS)  # as the engine's process sets it first
            set_budget(int(args["budget"]), str(got.path) if got is not None else args["uri"], fs_and_path)
            result["memory_limit"] = os.environ.get(MEMORY_LIMIT)
        live = relay_read.open_live(got.path) if got is not None and got.live else None
        if live is not None:  # what the vLLM rank does with a copy in progress (integrations/runai_loader.py)
            from ray_runai_shim.integrations.runai_loader import as_it_lands

            def streamer_iterator(path: str, *_rest: Any) -> Any:  # vLLM's own: the streamer on *path*'s files
                from runai_model_streamer import SafetensorsStreamer

                with SafetensorsStreamer() as streamer:
                    streamer.stream_files([f"{path}/{k}" for k in args["weights"]])
                    for name, tensor in streamer.get_tensors():
                        yield name, tensor.clone()

            result["tensors"] = live_tensors(as_it_lands(live, streamer_iterator, (str(got.path), None), {}))
        else:
            result["tensors"] = stream_tensors(paths)
        result["ready_s"] = time.monotonic() - t0
        result["first_tensor_s"] = TRACE["first"]
        if got is not None:
            got.wait()  # the fetcher's copy thread ends with the copy, as in an engine's process
            if got.fetched:  # the copy's duration, from this reader's start
                result["copy_s"] = (time.monotonic() - t0) if got.live else got.seconds
        time.sleep(float(args.get("hold", 0)))
        if got is not None and args.get("release", True):
            result["freed"] = relay.release(got)
            if args.get("released"):  # the test's sign that this reader has loaded and let go
                Path(args["released"]).write_text("")
            t_released = time.monotonic()
            got.wait_for_late_readers()  # as a replica lives on: the hold kept for the node's late readers
            result["waited_s"] = time.monotonic() - t_released
    else:
        result["tensors"] = stream_tensors([f"{args['uri']}/{k}" for k in args["weights"]])
        result["ready_s"] = time.monotonic() - t0
        result["first_tensor_s"] = TRACE["first"]
    return result


if __name__ == "__main__":
    import logging

    _said = logging.StreamHandler()  # the shim's lines on stderr, INFO included, as in an engine's log
    _said.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("ray.runai_shim").addHandler(_said)
    logging.getLogger("ray.runai_shim").setLevel(logging.INFO)
    try:
        print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
    except Exception as e:  # one JSON line either way
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
