"""Ray 2.51 end to end with ``runai_streamer_sharded``, the one format 2.51 forgot.

Ray 2.51 streams ``runai_streamer`` natively but copies a ``runai_streamer_sharded``
checkpoint whole to local disk. The shim appends the format to Ray's list; the
README example then runs on real Ray Data + the real vLLM engine, which loads a
sharded-state checkpoint (written by vLLM itself) straight from the bucket.
Run by the ``ray-2.51.2`` nox session.
"""

from __future__ import annotations

import ast
import shutil
import tempfile
from pathlib import Path

import pytest
import ray
from support.diskscan import find_weight_bytes
from support.fixtures import BUCKET, CACHE, make_sandbox
from support.pipeline import run_example
from support.procs import REPO
from support.runs import lazy_runs
from support.sharded_state import build_sharded_state
from support.tiny_model import build_tiny_model, upload_dir, weight_files

from ray_runai_shim.tables.support import SHARDED_FORMAT, plan_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(SHARDED_FORMAT not in plan_for(ray.__version__).patches, reason="Ray 2.51 only"),
]
FORMAT = "runai_streamer_sharded"
PREFIX = "llm/tiny-sharded-state"


def example_prompts() -> list[str]:
    tree = ast.parse((REPO / "examples" / "stream_from_s3.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PROMPTS":
            return ast.literal_eval(node.value)
    raise AssertionError("examples/stream_from_s3.py has no PROMPTS")


@pytest.fixture(scope="module")
def checkpoint(s3):
    import sys

    root = Path(tempfile.mkdtemp(prefix="rrs-ss-", dir="/tmp"))
    env = make_sandbox(s3, root).env
    local = CACHE / "tiny-sharded-state-v2"
    tokens = build_sharded_state(build_tiny_model(CACHE / "tiny-v1"), local, example_prompts(), env, sys.executable)
    shutil.rmtree(root, ignore_errors=True)
    upload_dir(s3.client(), local, BUCKET, PREFIX)
    return {"uri": f"s3://{BUCKET}/{PREFIX}", "local": local, "tokens": tokens, "weights": weight_files(local)}


@pytest.fixture(scope="module")
def runs(s3, checkpoint):
    """label ("control", "shim") -> the run, made on first use (a deselected control costs nothing)."""

    def make(label: str) -> dict:
        sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix=f"rrs-{label[:2]}-", dir="/tmp")))
        mark = len(s3.requests())
        result = run_example(sandbox, checkpoint["uri"], label == "shim", FORMAT)
        return dict(result, sandbox=sandbox, requests=s3.requests(mark))

    yield from lazy_runs(make)


def _on_disk(result, checkpoint) -> list[Path]:
    refs = {w: checkpoint["local"] / w for w in checkpoint["weights"]}
    return find_weight_bytes(result["sandbox"].scan_roots, refs)


def _tokens(result) -> dict:
    return {r["prompt"]: r["generated_tokens"] for r in result["rows"]}


def test_the_checkpoint_is_vllms_sharded_state(checkpoint):
    assert checkpoint["weights"] and all(w.startswith("model-rank-0-part-") for w in checkpoint["weights"])


# Extended: CI's subset (`./dev matrix-ci`) leaves it out -- the same session's release checks show
# Ray 2.51 alone copying every weight file of a `runai_streamer_sharded` checkpoint; `./dev matrix` runs it.
@pytest.mark.extended
def test_without_the_shim_ray_251_copies_the_sharded_checkpoint(runs, checkpoint):
    assert len(_on_disk(runs["control"], checkpoint)) == len(checkpoint["weights"])
    assert _tokens(runs["control"]) == checkpoint["tokens"]


def test_with_the_shim_vllm_streams_the_shards_and_nothing_lands_on_disk(runs, checkpoint):
    shim = runs["shim"]
    assert _on_disk(shim, checkpoint) == []
    calls = shim["sandbox"].engine_calls()
    assert calls and calls[0]["model"] == checkpoint["uri"]  # Ray hands vLLM the URI, as for runai_streamer
    assert all(c["model_weights_on_config"] == checkpoint["uri"] and c["load_format"] == FORMAT for c in calls)
    gets = [r for r in shim["requests"] if r.method == "GET" and "/model-rank-" in r.path]
    assert {r.path.rsplit("/", 1)[1] for r in gets} == set(checkpoint["weights"])
    assert all(r.status == 206 for r in gets)
    assert _tokens(shim) == checkpoint["tokens"]  # what vLLM itself generated from the local model
