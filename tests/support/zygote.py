"""Fresh interpreters for the import-order tests, forked from one that has already imported the
heavy third-party packages (torch, transformers, openai, ...) and none of the modules under test.

Each order of ``tests/test_import_order.py`` needs an interpreter where Ray, vLLM, wrapt's
hooks of the shim and the shim itself are not imported yet. Started afresh, every one of them
spends ~13 of its ~16 s importing torch, transformers and the like, which no order is about.
The zygote imports those once, in the order Ray and vLLM import them (learnt from one real
interpreter that imports every target module), checks that none of the modules under test came
with them, and forks one child per order: the child's ``sys.modules`` holds nothing of Ray,
vLLM or the shim, as a new interpreter's would. The test site dir's hooks are installed by the
zygote's own start, as they would be by the child's.

Where the zygote cannot be made (a preloaded package pulled in a module under test), callers
fall back to a new interpreter per order: slower, never different.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .procs import REPO

#: Top-level packages a child must import itself: what the orders are about, and the test
#: site dir's modules (loaded at interpreter start by both).
UNDER_TEST = ("ray", "vllm", "ray_runai_shim", "wrapt", "sitecustomize", "rrs_", "serve_compat", "user_hooks",
              "__main__")

LEARN = """
import importlib, json, sys
import ray
for m in json.loads(sys.argv[1]):
    try:
        importlib.import_module(m)
    except Exception:  # the order that imports it says why
        pass
print(json.dumps(list(sys.modules)))
"""

SERVER = r"""
import importlib, json, os, signal, sys, traceback
under_test = tuple(json.loads(sys.argv[1]))

def tainted():
    return sorted(m for m in sys.modules if m.split(".")[0].startswith(under_test) and m not in BASE)

BASE = set(sys.modules)  # the interpreter's own start (site hooks included): a child has them too
for name in json.loads(sys.stdin.readline()):
    if name in sys.modules:
        continue
    try:
        importlib.import_module(name)
    except BaseException:
        pass
    if tainted():
        print(json.dumps({"error": f"importing {name} imported {tainted()[:5]}"}), flush=True)
        sys.exit(0)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
print(json.dumps({"ready": len(sys.modules)}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    # the child: a fresh order's interpreter, as `python -c code` would run it
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    out = os.open(req["prefix"] + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(req["prefix"] + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0); os.dup2(out, 1); os.dup2(err, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["-c"]
    os.chdir(req["cwd"])
    code = 0
    try:
        exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        with open(req["prefix"] + ".rc", "w") as f:
            f.write(str(code))
        os._exit(code)
"""


class Zygote:
    """``Zygote(env, modules).run(code)``: *code* in a fork of an interpreter with the heavy
    dependencies of *modules* imported, as ``subprocess.run([python, "-c", code])`` would."""

    def __init__(self, env: dict[str, str], modules: list[str]) -> None:
        self.env = env
        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="rrs-zygote-"))
        self._n = 0
        learnt = subprocess.run([sys.executable, "-c", LEARN, json.dumps(modules)], env=env, cwd=str(REPO),
                                capture_output=True, text=True, timeout=600)
        if learnt.returncode != 0:
            raise RuntimeError(f"could not learn the imports: {learnt.stderr[-2000:]}")
        seen = json.loads(learnt.stdout.strip().splitlines()[-1])
        preload = [m for m in seen if not m.split(".")[0].startswith(UNDER_TEST)]
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(UNDER_TEST)], env=env, cwd=str(REPO),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send(preload)
        reply = self._reply()
        if "ready" not in reply:
            self.close()
            raise RuntimeError(f"no zygote: {reply.get('error')}")

    def _send(self, obj: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()

    def _reply(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else {"error": "the zygote exited"}

    def run(self, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
        with self._lock:
            self._n += 1
            prefix = str(self._dir / f"run{self._n}")
            self._send({"code": code, "prefix": prefix, "cwd": str(REPO)})
            pid = self._reply()["pid"]
        rc_file, deadline = Path(prefix + ".rc"), time.monotonic() + timeout
        returncode: Optional[int] = None
        while returncode is None:
            if rc_file.exists() and rc_file.read_text():
                returncode = int(rc_file.read_text())
            elif not Path(f"/proc/{pid}").exists():  # gone without a return code: killed by a signal
                time.sleep(0.2)
                returncode = int(rc_file.read_text()) if rc_file.exists() and rc_file.read_text() else -9
            elif time.monotonic() > deadline:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(code, timeout)
            else:
                time.sleep(0.05)
        out, err = Path(prefix + ".out").read_text(), Path(prefix + ".err").read_text()
        return subprocess.CompletedProcess([sys.executable, "-c", code], returncode, out, err)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
