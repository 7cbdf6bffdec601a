"""The seed's pipeline with Ray Data's default stages, on checkpoints saved the way they are today.

``examples/seed_pipeline.py`` is the ray#55574 script (chat messages; chat-template,
tokenize, vLLM and detokenize stages), run through real Ray Data actors and the real vLLM
CPU engine against moto. Two layouts Ray's tokenizer-only download cannot serve
(ray#62047): the chat template only in ``chat_template.jinja`` (kept from Ray 2.56, ray#62121),
and a GPT-2 style tokenizer (``vocab.json`` + ``merges.txt``, no ``tokenizer.json``; dropped
through 2.60).

Without the shim Ray fails in its own stages; with it every stage reads the same
non-weight snapshot, the store is listed once for the whole pipeline, no weight byte
reaches disk, and the engine receives the prompt rendered by the model's own template.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.fixtures import BUCKET, LAYOUT_MODELS, TinyModel, make_sandbox
from support.procs import REPO
from support.runs import lazy_runs

pytestmark = [pytest.mark.engine, pytest.mark.ray]

LAYOUTS = list(LAYOUT_MODELS)
SYSTEM = "You are a bot that responds with haikus."
RENDERED = f"system: {SYSTEM}\nuser: What is the capital of France?\nassistant:"
# What Ray's own stages say when the tokenizer-only download dropped the files they need.
RAY_FAILURES = {
    "jinja": ("chat_template is not set", "does not have a chat template", "no chat template"),
    "bpe-files": ("vocab", "merges", "Can't load tokenizer", "tokenizer", "TypeError", "OSError"),
}


def run_seed(s3, model: TinyModel, shim: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rrs-ds-", dir="/tmp"))
    sandbox = make_sandbox(s3, root)
    env = dict(sandbox.env)
    if not shim:
        env.update(RAY_RUNAI_SHIM_DISABLE="1", RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")
    out = root / "rows.json"
    mark = len(s3.requests())
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "seed_pipeline.py"), model.uri, "--cpu", "--json", str(out)],
        env=env, cwd=str(root), capture_output=True, text=True, timeout=900,
    )
    logs = "\n".join(p.read_text(errors="replace") for p in root.glob("tmp/ray/session_2*/logs/worker-*"))
    return {
        "ok": proc.returncode == 0,
        "rows": json.loads(out.read_text())["rows"] if out.exists() else None,
        "output": proc.stdout + proc.stderr + logs,
        "requests": s3.requests(mark),
        "sandbox": sandbox,
    }


@pytest.fixture(scope="module")
def runs(s3, layout_models):
    """(layout, shim) -> the run, made on first use (a deselected control costs nothing)."""
    yield from lazy_runs(lambda key: run_seed(s3, layout_models[key[0]], key[1]))


def listings(result, model: TinyModel) -> list:
    """ListObjects calls for the model's prefix: GETs on the bucket itself (the prefix travels in
    the query). The shim lists recursively; the streamer in vLLM lists the top level for its
    weight files (``delimiter=/``), which is the engine's own and not counted here."""
    return [r for r in result["requests"] if r.method == "GET" and r.path.rstrip("/") == f"/{BUCKET}"
            and f"prefix=llm/{model.name}" in r.query and "delimiter" not in r.query]


# The controls are extended (each a Ray-alone run of the whole pipeline, ~100 s): Ray's
# tokenizer-only download dropping chat_template.jinja, vocab.json and merges.txt is also shown by
# the release checks (test_tokenizer_only_download_of_current_checkpoints, CI: Ray 2.51, 2.60).
@pytest.mark.extended
@pytest.mark.parametrize("layout", LAYOUTS)
def test_control_ray_alone_fails_in_its_own_stages(runs, layout):
    control = runs[(layout, False)]
    assert not control["ok"] and control["rows"] is None
    assert any(s in control["output"] for s in RAY_FAILURES[layout]), control["output"][-3000:]


# CI runs the bpe-files layout (dropped by Ray's tokenizer-only download through 2.60); the jinja
# layout (kept from 2.56) takes the same snapshot route and is extended.
SHIM_LAYOUTS = [pytest.param(x, marks=pytest.mark.extended) if x == "jinja" else x for x in LAYOUTS]


@pytest.mark.parametrize("layout", SHIM_LAYOUTS)
def test_with_the_shim_the_default_pipeline_answers_from_the_models_own_template(runs, layout_models, layout):
    run, model = runs[(layout, True)], layout_models[layout]
    assert run["ok"], run["output"][-6000:]
    rows = {r["item"]: r for r in run["rows"]}
    assert len(rows) == 2
    france = rows["What is the capital of France?"]
    # The chat-template stage rendered the checkpoint's own template (chat_template.jinja).
    assert france["prompt"] == RENDERED
    assert all(len(r["generated_tokens"]) > 0 and isinstance(r["answer"], str) for r in rows.values())
    # vLLM streamed the weights; none reached local disk.
    assert run["sandbox"].weight_bytes_on_disk(model) == []
    [call, *_] = run["sandbox"].engine_calls()
    assert call["model_weights"] == model.uri


@pytest.mark.parametrize("layout", SHIM_LAYOUTS)
def test_every_stage_reads_one_snapshot_listed_once(runs, layout_models, layout):
    run, model = runs[(layout, True)], layout_models[layout]
    [snapshot] = run["sandbox"].shim_dirs()
    [call, *_] = run["sandbox"].engine_calls()
    assert Path(call["model"]).resolve() == snapshot.resolve()
    for rel in ("chat_template.jinja", *(["vocab.json", "merges.txt"] if layout == "bpe-files" else [])):
        assert (snapshot / rel).read_bytes() == (model.local / rel).read_bytes()
    # Driver, chat-template, tokenize, vLLM and detokenize stages: one listing of the prefix,
    # each non-weight object fetched once (and its identity checked by HEAD, never re-read).
    assert len(listings(run, model)) == 1, [r.path for r in run["requests"]]
    gets = [r.path for r in run["requests"] if r.method == "GET" and r.path.startswith(f"/{BUCKET}/llm/{model.name}/")]
    nonweight_gets = [p for p in gets if not p.endswith(".safetensors")]
    assert sorted(nonweight_gets) == sorted(f"/{BUCKET}/llm/{model.name}/{f}" for f in model.nonweights)
    # Ray's own models--… cache was never written.
    assert not list((run["sandbox"].root / "hf" / "hub").glob("models--*"))
