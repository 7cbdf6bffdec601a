"""End to end: the README example (ray#55574's reproduction) on real Ray Data + real vLLM.

Ray 2.48 starts a local cluster, Ray Data runs the vLLM stage in a real actor, the
real vLLM CPU engine loads the tiny model from the moto bucket. The same pipeline
runs once without the shim (the control, which must copy the weights) and once
with it; greedy decoding must give the same tokens both ways.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import ray
from support.fixtures import BUCKET, make_sandbox
from support.pipeline import run_example

from ray_runai_shim.tables.support import parse_version

pytestmark = [pytest.mark.engine, pytest.mark.ray]
MODEL = "tiny-sharded"


# Ray 2.50 already skips *.safetensors but still hands vLLM the (now weightless) local
# copy, so there the control fails to load and the token reference is a plain full load.
RAY_DROPS_WEIGHTS = parse_version(ray.__version__)[:2] == (2, 50)


@pytest.fixture(scope="module")
def runs(s3, models, tmp_path_factory):
    import tempfile

    results = {}
    cases = [
        ("control", False, {}, "runai_streamer"),
        ("shim", True, {}, "runai_streamer"),
    ]
    if RAY_DROPS_WEIGHTS:
        cases.append(("reference", False, {}, "auto"))
    for label, shim, extra, fmt in cases:
        root = Path(tempfile.mkdtemp(prefix=f"rrs-{label[:2]}-", dir="/tmp"))
        sandbox = make_sandbox(s3, root, **extra)
        mark = len(s3.requests())
        result = run_example(sandbox, models[MODEL].uri, shim, fmt, check=label != "control")
        result.update(sandbox=sandbox, requests=s3.requests(mark))
        results[label] = result
    yield results
    for result in results.values():
        shutil.rmtree(result["sandbox"].root, ignore_errors=True)


def weight_requests(result, model) -> list:
    keys = {f"/{BUCKET}/llm/{model.name}/{w}" for w in model.weights}
    return [r for r in result["requests"] if r.method == "GET" and r.path in keys]


def reference(runs) -> dict:
    """Tokens of the same prompts loaded without streaming."""
    return runs["reference"] if RAY_DROPS_WEIGHTS else runs["control"]


def local_dir(sandbox) -> str:
    """Where vLLM's config/tokenizer came from: the shim's narrowed snapshot, or on Ray 2.50
    (handoff only) Ray's own snapshot, which 2.50 already downloads without *.safetensors."""
    if RAY_DROPS_WEIGHTS:
        [snapshot] = (sandbox.root / "hf" / "hub").glob("models--s3*/snapshots/*")
        return str(snapshot)
    [shim_dir] = sandbox.shim_dirs()
    return str(shim_dir)


def test_control_without_the_shim_copies_every_weight_to_local_disk(runs, models):
    model, control = models[MODEL], runs["control"]
    [call, *_] = control["sandbox"].engine_calls()
    if RAY_DROPS_WEIGHTS:  # the local copy has no weights and vLLM is not told where they are
        assert control["rows"] is None
        assert not set(model.weights) & set(call["model_dir_listing"])
        assert call["model_weights"] in (None, "")
        assert "Cannot find any safetensors model weights" in control["stderr"] + control["worker_logs"]
        return
    assert "/models--s3:----models--llm--tiny-sharded/snapshots/" in call["model"]
    assert set(model.weights) <= set(call["model_dir_listing"])
    assert len(control["sandbox"].weight_bytes_on_disk(model)) == len(model.weights)


def test_with_the_shim_vllm_streams_the_weights_and_nothing_lands_on_disk(runs, models):
    model, shim = models[MODEL], runs["shim"]
    sandbox = shim["sandbox"]
    calls = sandbox.engine_calls()
    assert calls, "vLLM was never reached"
    local = local_dir(sandbox)
    for call in calls:  # Ray builds the config twice; both see the same handoff
        assert call["model"] == local
        assert call["model_weights"] == model.uri
        assert call["load_format"] == "runai_streamer"
    assert sorted(f for f in calls[0]["model_dir_listing"] if not f.startswith(".")) == model.nonweights
    # HOME, HF cache, TMPDIR (Ray's session dir), XDG cache (vLLM's assets): no weight byte.
    assert sandbox.weight_bytes_on_disk(model) == []
    assert not list((sandbox.root / "hf" / "hub").glob("models--s3*/snapshots/*/*.safetensors"))
    # The weights were read from the bucket (by the streamer, in ranges) rather than copied.
    streamed = weight_requests(shim, model)
    assert {r.path.rsplit("/", 1)[1] for r in streamed} == set(model.weights)
    assert all(r.status == 206 for r in streamed)
    # vLLM's engine logged loading through the Run:ai streamer.
    assert "Run:ai Model Streamer" in shim["worker_logs"] or "runai" in shim["worker_logs"].lower()


def test_same_tokens_through_the_shim_as_through_the_full_download(runs):
    def tokens(result):
        return {r["prompt"]: r["generated_tokens"] for r in result["rows"]}

    shim, control = tokens(runs["shim"]), tokens(reference(runs))
    assert len(shim) == 4 and all(len(t) > 0 for t in shim.values())
    assert shim == control


def test_one_info_line_per_actor_says_what_happened(runs, models):
    logs = runs["shim"]["worker_logs"]
    # (Ray >= 2.50 prints worker log records without the level name.)
    lines = [line for line in logs.splitlines() if "ray-runai-shim: " in line and "streams weights from" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    if RAY_DROPS_WEIGHTS:  # Ray fetched the non-weight files itself; the shim only hands off
        assert f"vLLM reads config/tokenizer from {local_dir(runs['shim']['sandbox'])}" in line
    else:
        # The driver's config read (a tokenizer-only download, served from the same snapshot)
        # fetched first in this job; the stage on the same node reuses it.
        assert re.search(r"(fetched|reused) 7 non-weight files", line) and "skipped 2 weight files" in line
    assert f"streams weights from {models[MODEL].uri}" in line and "load_format=runai_streamer" in line


@pytest.fixture(scope="module")
def config_run(s3, models):
    """The route for vLLM < 0.14 (weights URI set on every built ModelConfig), forced on
    vLLM 0.32 so the real engine proves it loads through that route too. Extended: the
    matrix's vllm-0.8.5/0.10.2 sessions run that route on those vLLMs' own loaders."""
    import tempfile

    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix="rrs-co-", dir="/tmp")),
                           RAY_RUNAI_SHIM_HANDOFF="config")
    mark = len(s3.requests())
    result = run_example(sandbox, models[MODEL].uri, True)
    result.update(sandbox=sandbox, requests=s3.requests(mark))
    yield result
    shutil.rmtree(sandbox.root, ignore_errors=True)


@pytest.mark.extended
def test_the_config_injection_route_for_older_vllm_streams_too(runs, config_run, models):
    model, run = models[MODEL], config_run
    sandbox = run["sandbox"]
    calls = sandbox.engine_calls()
    assert calls and all(c["model"] == local_dir(sandbox) for c in calls)
    assert all(c["model_weights"] in (None, "") for c in calls)  # not passed as an argument
    assert sandbox.weight_bytes_on_disk(model) == []
    assert {r.path.rsplit("/", 1)[1] for r in weight_requests(run, model)} == set(model.weights)
    tokens = {r["prompt"]: r["generated_tokens"] for r in run["rows"]}
    assert tokens == {r["prompt"]: r["generated_tokens"] for r in reference(runs)["rows"]}
