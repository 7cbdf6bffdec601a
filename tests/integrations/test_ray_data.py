"""Ray 2.48's real ``vLLMEngineStageUDF`` against real S3 and real vLLM config building.

Each case constructs the stage in a fresh interpreter, the way a Ray Data actor
does. vLLM builds its real ``VllmConfig`` from what the stage hands it (that
reads config.json from the local dir and validates the load format); the
recorder in tests/support/site then stops before the engine starts, since the
engine itself is exercised end to end in test_pipeline.py.
"""

from __future__ import annotations

import pytest
from support.fixtures import BUCKET
from support.procs import last_json, run_python

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

MANIFEST = ".ray-runai-shim.json"
STOP = {"RAY_RUNAI_SHIM_TEST_STOP_AFTER_CONFIG": "1"}

CONSTRUCT = """
import json, os, sys
{preamble}
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF
error = None
try:
    vLLMEngineStageUDF(
        data_column="__data", expected_input_keys=["prompt", "sampling_params"],
        batch_size=4, max_concurrent_batches=2, model={model!r},
        engine_kwargs={engine_kwargs!r},
    )
except BaseException as e:
    error = type(e).__name__ + ": " + str(e)
print(json.dumps({{"error": error}}))
"""


def construct(sandbox, model: str, engine_kwargs: dict, shim: bool = True, **env: str) -> dict:
    preamble = "import ray_runai_shim" if shim else ""
    code = CONSTRUCT.format(preamble=preamble, model=model, engine_kwargs=engine_kwargs)
    full_env = {**sandbox.env, **STOP, **env}
    if not shim:
        full_env.update(RAY_RUNAI_SHIM_DISABLE="1", RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER="1")
    return last_json(run_python(code, env=full_env))


def streaming_kwargs(fmt: str = "runai_streamer") -> dict:
    return {"load_format": fmt, "max_model_len": 128, "dtype": "float32", "enforce_eager": True}


def weight_gets(s3, model, since: int) -> list:
    keys = {f"/{BUCKET}/llm/{model.name}/{w}" for w in model.weights}
    return [r for r in s3.requests(since) if r.method == "GET" and r.path in keys]


@pytest.mark.parametrize("name", ["tiny", "tiny-sharded"])
def test_streaming_stage_fetches_only_non_weights_and_hands_vllm_the_uri(s3, models, sandbox, name):
    model = models[name]
    mark = len(s3.requests())
    out = construct(sandbox, model.uri, streaming_kwargs())
    assert "stopped before engine start" in out["error"]

    [call] = sandbox.engine_calls()
    [shim_dir] = sandbox.shim_dirs()
    assert call["model"] == str(shim_dir)
    assert call["model_weights"] == model.uri
    assert call["model_weights_on_config"] == model.uri  # what the engine core will load
    assert call["load_format"] == "runai_streamer"
    # Every non-weight file, sub-folders included, and nothing else.
    assert sorted(f for f in call["model_dir_listing"] if f != MANIFEST) == model.nonweights
    for rel in model.nonweights:
        assert (shim_dir / rel).read_bytes() == (model.local / rel).read_bytes()
    # No weight byte anywhere under HOME, the HF cache, TMPDIR or XDG cache; no weight GET.
    assert sandbox.weight_bytes_on_disk(model) == []
    assert weight_gets(s3, model, mark) == []
    # Ray's own full-snapshot directory was never created.
    assert not list((sandbox.root / "hf" / "hub").glob("models--*"))


def test_distributed_streaming_for_tensor_parallel_reaches_vllm_untouched(s3, models, sandbox):
    """``model_loader_extra_config={"distributed": true}`` (each TP rank streams a share) is the
    documented route for tensor parallel: the handoff passes it, and the TP size, through as given."""
    model = models["tiny-sharded"]
    kwargs = {**streaming_kwargs(), "tensor_parallel_size": 2,
              "model_loader_extra_config": {"distributed": True, "concurrency": 4}}
    out = construct(sandbox, model.uri, kwargs)
    assert "stopped before engine start" in out["error"]
    [call] = sandbox.engine_calls()
    assert call["model_loader_extra_config"] == {"distributed": True, "concurrency": 4}
    assert call["tensor_parallel_size"] == 2
    assert call["model"] == str(sandbox.shim_dirs()[0]) and call["model_weights"] == model.uri


def test_a_second_stage_on_the_node_reuses_the_complete_snapshot(s3, models, sandbox):
    model = models["tiny"]
    construct(sandbox, model.uri, streaming_kwargs())
    mark = len(s3.requests())
    construct(sandbox, model.uri, streaming_kwargs())
    gets = [r for r in s3.requests(mark) if r.method == "GET" and f"/llm/{model.name}/" in r.path]
    assert gets == []  # only the listing went to S3 the second time
    assert [c["model"] for c in sandbox.engine_calls()] == [str(sandbox.shim_dirs()[0])] * 2


def test_without_the_shim_ray_copies_the_weights_to_disk(s3, models, sandbox):
    """The control: the bug this package exists for (ray#55574), reproduced."""
    model = models["tiny-sharded"]
    mark = len(s3.requests())
    construct(sandbox, model.uri, streaming_kwargs(), shim=False)
    [call] = sandbox.engine_calls()
    assert "/models--s3:----models--llm--tiny-sharded/snapshots/" in call["model"]
    assert call["model_weights"] in (None, "")
    assert set(model.weights) <= set(call["model_dir_listing"])
    assert len(sandbox.weight_bytes_on_disk(model)) == len(model.weights)
    # pyarrow reads whole objects with ranged GETs too, so what tells the runs apart is
    # that the weight objects were fetched at all, and landed on disk.
    assert {r.path.rsplit("/", 1)[1] for r in weight_gets(s3, model, mark)} == set(model.weights)


def _kwargs_without_format(**extra):
    kw = streaming_kwargs()
    kw.pop("load_format")
    kw.update(extra)
    return kw


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        streaming_kwargs("auto"),  # (safetensors takes the same non-streaming branch: decide.py's tests)
        # The other non-streaming requests take the same branch (decide.py's tests): extended.
        pytest.param(streaming_kwargs("no_such_format"), marks=pytest.mark.extended),
        # The streamer's options without load_format: not a streaming request.
        pytest.param(_kwargs_without_format(model_loader_extra_config={"concurrency": 4}),
                     marks=pytest.mark.extended),
    ],
    ids=["auto", "unknown", "extra-config-only"],
)
def test_non_streaming_requests_get_exactly_rays_behaviour(s3, models, sandbox, engine_kwargs):
    model = models["tiny"]
    with_shim = construct(sandbox, model.uri, engine_kwargs)
    calls_with = sandbox.engine_calls()
    if sandbox.engine_log.exists():
        sandbox.engine_log.unlink()
    without = construct(sandbox, model.uri, engine_kwargs, shim=False)
    calls_without = sandbox.engine_calls()
    for c in calls_with + calls_without:
        c.pop("pid")
    assert calls_with == calls_without  # what vLLM received, call for call
    assert with_shim == without  # and the same outcome (vLLM's own error for an unknown format)
    for c in calls_with:
        assert c["model_weights"] in (None, "") and "model.safetensors" in c["model_dir_listing"]
    assert sandbox.shim_dirs() == []
    # Ray's full snapshot, weights included, either way.
    assert list((sandbox.root / "hf" / "hub").glob("models--*/snapshots/*/model.safetensors"))


def test_local_path_and_hub_id_are_untouched(models, sandbox):
    model = models["tiny"]
    construct(sandbox, str(model.local), streaming_kwargs())
    [local_call] = sandbox.engine_calls()
    assert local_call["model"] == str(model.local) and local_call["model_weights"] in (None, "")
    # A hub id reaches vLLM as is: offline, vLLM's own hub lookup is what fails.
    out = construct(sandbox, "example-org/tiny-llama", streaming_kwargs())
    assert out["error"].startswith("LocalEntryNotFoundError")
    assert sandbox.shim_dirs() == []


def test_an_azure_source_gets_rays_own_outcome_and_a_warning_naming_the_route(sandbox):
    """Azure is not streamed by the shim (ray_runai_shim/stores/azure.py says why): the stage gets
    exactly Ray's outcome, plus one WARNING, where Ray alone is silent."""
    src = "abfss://models@acct.dfs.core.windows.net/llm/tiny?sv=2024&sig=SECRET"
    runs = {}
    for shim in (True, False):
        code = CONSTRUCT.format(preamble="import ray_runai_shim" if shim else "", model=src,
                                engine_kwargs=streaming_kwargs())
        env = {**sandbox.env, **STOP, **({} if shim else {"RAY_RUNAI_SHIM_DISABLE": "1"})}
        runs[shim] = run_python(code, env=env)
    assert last_json(runs[True]) == last_json(runs[False])  # Ray's own outcome, unchanged
    assert last_json(runs[True])["error"]  # (Ray 2.48 cannot read Azure at all)
    warned = [ln for ln in runs[True].stderr.splitlines() if "is an Azure source" in ln]
    assert len(warned) == 1 and "WARNING" in warned[0]
    assert "az://<container>/<path>" in warned[0] and "AZURE_STORAGE_ACCOUNT_NAME" in warned[0]
    assert "SECRET" not in runs[True].stderr.replace(src, "")  # the SAS token is not repeated
    assert "Azure source" not in runs[False].stderr
    assert sandbox.shim_dirs() == []


def test_streaming_a_checkpoint_without_safetensors_fails_before_the_engine(s3, models, sandbox, tmp_path):
    model = models["tiny"]
    client = s3.client()
    for rel in model.nonweights:
        client.upload_file(str(model.local / rel), BUCKET, f"llm/bin-only/{rel}")
    client.put_object(Bucket=BUCKET, Key="llm/bin-only/pytorch_model.bin", Body=b"\0" * 1024)
    out = construct(sandbox, f"s3://{BUCKET}/llm/bin-only", streaming_kwargs())
    assert out["error"].startswith("ShimError: ")
    assert "s3://models/llm/bin-only" in out["error"] and ".safetensors" in out["error"]
    assert "load_format='auto'" in out["error"]  # the fix is named
    assert sandbox.engine_calls() == []  # vLLM was never reached
    assert sandbox.shim_dirs() == []  # nothing half-written


def test_missing_prefix_names_the_uri_and_endpoint(s3, sandbox):
    out = construct(sandbox, f"s3://{BUCKET}/llm/does-not-exist", streaming_kwargs())
    assert out["error"].startswith("ShimError: ")
    assert f"s3://{BUCKET}/llm/does-not-exist" in out["error"] and s3.endpoint in out["error"]
    assert "testing" not in out["error"]  # never the secret


def test_rays_own_downloads_honour_aws_endpoint_url(s3, models, sandbox):
    """Ray 2.48's pyarrow filesystem ignores AWS_ENDPOINT_URL; with the shim it reaches the store."""
    code = """
    import json
    {preamble}
    from ray.llm._internal.common.utils.download_utils import NodeModelDownloadable, download_model_files
    try:
        path = download_model_files(model_id={uri!r}, download_model=NodeModelDownloadable.TOKENIZER_ONLY,
                                    download_extra_files=False)
        import os
        print(json.dumps({{"files": sorted(os.listdir(path)), "error": None}}))
    except Exception as e:
        print(json.dumps({{"error": type(e).__name__ + ": " + str(e)}}))
    """
    uri = models["tiny"].uri
    env = {k: v for k, v in sandbox.env.items() if k != "RAY_RUNAI_SHIM_TEST_ENDPOINT_ADAPTER"}
    with_shim = last_json(run_python(code.format(preamble="import ray_runai_shim", uri=uri), env=env))
    without = last_json(run_python(code.format(preamble="", uri=uri), env={**env, "RAY_RUNAI_SHIM_DISABLE": "1"}))
    assert with_shim["error"] is None and "config.json" in with_shim["files"]
    assert without["error"] is not None  # Ray alone tries <bucket>.s3.amazonaws.com


def test_after_a_streaming_stage_a_non_streaming_stage_still_gets_the_full_model(models, sandbox):
    """The narrowed snapshot lives apart from Ray's, so it is never taken for a full one (ray#64996)."""
    model = models["tiny"]
    construct(sandbox, model.uri, streaming_kwargs())
    construct(sandbox, model.uri, streaming_kwargs("auto"))
    streaming, full = sandbox.engine_calls()
    assert streaming["model"] == str(sandbox.shim_dirs()[0])
    assert full["model"] != streaming["model"] and full["model_weights"] in (None, "")
    assert set(model.weights) <= set(full["model_dir_listing"])


def test_a_missing_streamer_backend_names_the_pip_package(models, sandbox, tmp_path):
    # Shadow the installed backend with one that fails to import, as on an image without it.
    shadow = tmp_path / "shadow" / "runai_model_streamer_s3"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named runai_model_streamer_s3')\n")
    env = {"PYTHONPATH": f"{shadow.parent}:{sandbox.env['PYTHONPATH']}"}
    out = construct(sandbox, models["tiny"].uri, streaming_kwargs(), **env)
    assert out["error"].startswith("ShimError: ")
    assert "runai_model_streamer_s3" in out["error"] and '"pip": ["runai-model-streamer[s3]"]' in out["error"]
    assert sandbox.engine_calls() == [] and sandbox.shim_dirs() == []


def test_four_stages_and_a_tokenizer_download_start_at_once_on_one_node(s3, models, sandbox):
    """Four actors on a node, plus another stage's tokenizer-only download (Ray shares one lock
    per model id between those): every stage reaches vLLM with the complete non-weight dir, each
    file is fetched once, and nobody trips over anybody's files (cf. ray#60681)."""
    import subprocess
    import sys
    import textwrap

    model = models["tiny-sharded"]
    mark = len(s3.requests())
    env = {**sandbox.env, **STOP}
    stage = CONSTRUCT.format(preamble="import ray_runai_shim", model=model.uri, engine_kwargs=streaming_kwargs())
    tok = textwrap.dedent(
        f"""
        import ray_runai_shim, json
        from ray.llm._internal.common.utils.download_utils import NodeModelDownloadable, download_model_files
        print(json.dumps({{"path": download_model_files(model_id={model.uri!r},
              download_model=NodeModelDownloadable.TOKENIZER_ONLY, download_extra_files=False)}}))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for code in [stage] * 4 + [tok]
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, [o[1][-2000:] for o in outs]
    for stdout, _ in outs[:4]:
        assert "stopped before engine start" in stdout
    calls = sandbox.engine_calls()
    [shim_dir] = sandbox.shim_dirs()
    assert len(calls) == 4 and {c["model"] for c in calls} == {str(shim_dir)}
    assert all(sorted(f for f in c["model_dir_listing"] if not f.startswith(".")) == model.nonweights for c in calls)
    gets = [r.path for r in s3.requests(mark) if r.method == "GET"]
    # Files only the shim fetches (Ray's tokenizer-only filter skips them): exactly once each.
    for rel in ("chat_template.jinja", "extra/notes.txt", "model.safetensors.index.json"):
        assert gets.count(f"/{BUCKET}/llm/tiny-sharded/{rel}") == 1, rel
    assert sandbox.weight_bytes_on_disk(model) == []
