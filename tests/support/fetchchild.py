"""Run one real ``fetch_nonweights`` in a process of its own.

For what a test cannot do in-process: ``kill -9`` mid-fetch, another uid,
a file-size limit, a snapshot held open by a live process. Run as
``python fetchchild.py '<json args>'``; prints one JSON line (the result or the
error), then, with ``hold``, keeps the snapshot in use and answers each stdin
line with the sha256 of every file in it, until stdin closes.

args: uri, endpoint, root (optional; default: the cache from the environment),
chunk (bytes per read), slow (seconds of sleep per read), probe_write (a
directory: report whether this process can write it, the way the old code tried).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

CHILD = Path(__file__).resolve()


class _SlowStream:
    def __init__(self, stream: Any, delay: float) -> None:
        self.stream, self.delay = stream, delay

    def __enter__(self) -> _SlowStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def metadata(self) -> Any:
        return self.stream.metadata()

    def read(self, n: int) -> bytes:
        time.sleep(self.delay)
        return self.stream.read(n)


class _SlowFs:
    """A pyarrow filesystem whose reads sleep first (a slow store)."""

    def __init__(self, fs: Any, delay: float) -> None:
        self.fs, self.delay = fs, delay

    def get_file_info(self, selector: Any) -> Any:
        return self.fs.get_file_info(selector)

    def open_input_stream(self, path: str, **kwargs: Any) -> _SlowStream:
        return _SlowStream(self.fs.open_input_stream(path, **kwargs), self.delay)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def main() -> None:
    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stderr)
    from ray_runai_shim.errors import ShimError
    from ray_runai_shim.snapshot import fetch
    from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem

    out: dict[str, Any] = {"uid": os.getuid()}
    if args.get("probe_write"):
        probe = Path(args["probe_write"])
        out["writable"] = os.access(probe, os.W_OK)
        try:
            (probe / "ray-runai-shim").mkdir(parents=True, exist_ok=True)  # what the old code did
            out["old_mkdir"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["old_mkdir"] = type(e).__name__
    if args.get("chunk"):
        fetch.CHUNK_BYTES = int(args["chunk"])

    def fs_and_path(uri: str) -> tuple[Any, str]:
        fs = endpoint_s3_filesystem(False, args["endpoint"])
        return (_SlowFs(fs, args["slow"]) if args.get("slow") else fs), uri.split("://", 1)[1]

    try:
        root = Path(args["root"]) if args.get("root") else None
        r = fetch.fetch_nonweights(args["uri"], "runai_streamer", fs_and_path=fs_and_path, root=root)
        out.update(local_dir=r.local_dir, reused=r.reused, fetched_files=r.fetched_files, private=r.private)
    except ShimError as e:
        out.update(error=str(e), type="ShimError")
    except BaseException as e:  # noqa: BLE001 - the test asserts on the type
        out.update(error=f"{type(e).__name__}: {e}", type=type(e).__name__)
    print(json.dumps(out), flush=True)
    if args.get("hold") and "local_dir" in out:
        for _line in sys.stdin:
            print(json.dumps(_digests(Path(out["local_dir"]))), flush=True)


# --------------------------------------------------------------------------- the parent's side


def child_env(s3: Any, home: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: PATH, HOME, the S3 server's settings, *extra*."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", **s3.env()}
    env.update(extra)
    return env


def start_child(
    args: dict[str, Any],
    env: dict[str, str],
    uid: Optional[int] = None,
    fsize: Optional[int] = None,
    hold: bool = False,
    wrap: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start this script; *uid* runs it as that user (``setpriv``), *fsize* caps the file
    size it may write (``RLIMIT_FSIZE``), *wrap* prefixes the command (e.g. ``unshare``)."""

    def pre() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return subprocess.Popen(
        [*wrap, *as_user, sys.executable, str(CHILD), json.dumps({**args, "hold": hold})],
        env=env,
        stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=pre,
    )


def run_child(args: dict[str, Any], env: dict[str, str], **kw: Any) -> tuple[dict[str, Any], str]:
    """Run to completion: (its JSON result, its stderr)."""
    proc = start_child(args, env, **kw)
    out, err = proc.communicate(timeout=120)
    if not out.strip():
        raise AssertionError(f"child printed nothing (rc {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1]), err


if __name__ == "__main__":
    main()
