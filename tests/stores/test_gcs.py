"""``gs://`` end to end against a real GCS JSON-API server (fake-gcs-server on 127.0.0.1).

Nothing is adapted: Ray's pyarrow ``GcsFileSystem`` and the streamer's C++ backend reach
the server through ``CLOUD_STORAGE_EMULATOR_ENDPOINT``, vLLM's listing (the streamer's
Python client) through ``STORAGE_EMULATOR_HOST`` (support/gcsserver.py). The README
example runs on Ray 2.48 + the vLLM CPU engine without the shim (the control: Ray copies
every weight) and with it (the weights stream; none reach disk; the same tokens).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.fixtures import make_sandbox
from support.gcsserver import GcsServer, start_gcs_server
from support.procs import REPO, base_env

from ray_runai_shim.errors import ShimError
from ray_runai_shim.snapshot.fetch import fetch_nonweights

pytestmark = [pytest.mark.engine, pytest.mark.ray]
BUCKET = "gcs-models"
MODEL = "tiny-sharded"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory, models) -> GcsServer:
    server = start_gcs_server(tmp_path_factory.mktemp("gcs"))
    server.create_bucket(BUCKET)
    for name in ("tiny", MODEL):
        server.upload_dir(models[name].local, BUCKET, f"llm/{name}")
    yield server
    server.stop()


def uri(name: str = MODEL) -> str:
    return f"gs://{BUCKET}/llm/{name}"


@pytest.fixture
def gcs_env(gcs, monkeypatch):
    """This process talks to the server the way a user's process would: by environment."""
    for k, v in gcs.env().items():
        monkeypatch.setenv(k, v)
    return gcs


def media_reads(gcs: GcsServer, since: int) -> list[str]:
    return [r.object_key for r in gcs.requests(since) if r.object_key]


# ----------------------------------------------------------------- the shim's fetch, in process


def test_the_fetch_copies_only_non_weight_files_each_read_once(gcs_env, models, tmp_path):
    model, mark = models[MODEL], len(gcs_env.requests())
    result = fetch_nonweights(uri(), "runai_streamer", root=tmp_path)
    got = sorted(p.relative_to(result.local_dir).as_posix() for p in Path(result.local_dir).rglob("*")
                 if p.is_file() and not p.name.startswith("."))
    assert got == model.nonweights
    for rel in got:
        assert (Path(result.local_dir) / rel).read_bytes() == (model.local / rel).read_bytes()
    # Only non-weight objects were read. (pyarrow's GCS streams start a media download even
    # for the identity probe, so each is requested twice here; S3 probes with a HEAD.)
    nonweights = {f"{BUCKET}/llm/{MODEL}/{rel}" for rel in model.nonweights}
    assert set(media_reads(gcs_env, mark)) == nonweights
    # A second fetch of the unchanged model reuses the snapshot; no weight is ever read.
    mark = len(gcs_env.requests())
    again = fetch_nonweights(uri(), "runai_streamer", root=tmp_path)
    assert again.reused and again.local_dir == result.local_dir
    assert set(media_reads(gcs_env, mark)) <= nonweights


def test_the_emulator_endpoint_is_part_of_the_cache_key_and_the_messages(gcs_env, tmp_path):
    from ray_runai_shim.snapshot.fetch import default_fs_and_path
    from ray_runai_shim.stores.endpoint import store_identity

    store = store_identity(default_fs_and_path(uri())[0], uri())
    assert store.endpoint == gcs_env.endpoint  # not "the default Google Cloud Storage endpoint"
    assert gcs_env.endpoint in store.key()


def test_no_such_bucket_names_the_uri_the_endpoint_and_the_fix(gcs_env, tmp_path):
    with pytest.raises(ShimError) as err:
        fetch_nonweights("gs://no-such-bucket/llm/tiny", "runai_streamer", root=tmp_path)
    msg = str(err.value)
    assert "gs://no-such-bucket/llm/tiny" in msg and gcs_env.endpoint in msg
    assert "no such bucket" in msg and "gs:// URI" in msg
    assert "PRIVATE KEY" not in msg and "service-account" not in msg  # no credential material
    assert [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []  # nothing half-written


def test_a_missing_prefix_in_an_existing_bucket_is_a_clear_error(gcs_env, tmp_path):
    with pytest.raises(ShimError) as err:
        fetch_nonweights(uri("no-such-model"), "runai_streamer", root=tmp_path)
    msg = str(err.value)
    assert uri("no-such-model") in msg and gcs_env.endpoint in msg


def doctor(env: dict[str, str], *args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "ray_runai_shim", "doctor", *args], env=env,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_doctor_lists_a_gcs_model_and_flags_a_half_set_emulator_endpoint(gcs, models):
    env = {**base_env(), **gcs.env()}
    code, out = doctor(env, uri())
    assert code == 0 and "verdict: ok" in out and "WARNING" not in out.split("\nmodel ", 1)[1]
    for w in models[MODEL].weights:
        assert w in out  # listed as streamed
    del env["STORAGE_EMULATOR_HOST"]
    code, out = doctor(env, uri())
    assert f"Fix: set STORAGE_EMULATOR_HOST={gcs.endpoint} too" in out


def test_doctor_flags_an_emulator_host_without_the_cpp_endpoint(monkeypatch):
    # In process: without CLOUD_STORAGE_EMULATOR_ENDPOINT a listing would go to Google itself.
    from ray_runai_shim.doctor import gcs_endpoint_warnings

    monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    [warning] = gcs_endpoint_warnings("gs://b/m")
    assert "Fix: set CLOUD_STORAGE_EMULATOR_ENDPOINT=http://127.0.0.1:9 too" in warning
    assert gcs_endpoint_warnings("s3://b/m") == []


# ----------------------------------------------------------------- the README example on gs://


def run_example(sandbox, source: str, shim: bool) -> dict:
    env = dict(sandbox.env)
    if not shim:
        env["RAY_RUNAI_SHIM_DISABLE"] = "1"
    out = sandbox.root / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "stream_from_s3.py"), source, "--cpu", "--json", str(out)],
        env=env, cwd=str(sandbox.root), capture_output=True, text=True, timeout=900,
    )
    logs = "\n".join(p.read_text(errors="replace") for p in sandbox.root.glob("tmp/ray/session_2*/logs/worker-*"))
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {"rows": json.loads(out.read_text())["rows"], "worker_logs": logs}


def example_run(s3, gcs, label: str, shim: bool):
    sandbox = make_sandbox(s3, Path(tempfile.mkdtemp(prefix=f"rrs-g{label[:1]}-", dir="/tmp")), **gcs.env())
    mark = len(gcs.requests())
    return {**run_example(sandbox, uri(), shim), "sandbox": sandbox, "mark": mark, "reads": media_reads(gcs, mark)}


@pytest.fixture(scope="module")
def shim_run(s3, gcs):
    result = example_run(s3, gcs, "shim", True)
    yield result
    shutil.rmtree(result["sandbox"].root, ignore_errors=True)


@pytest.fixture(scope="module")
def control_run(s3, gcs):
    """Ray alone, from the same bucket (run only where a test asks: the extended ones)."""
    result = example_run(s3, gcs, "control", False)
    yield result
    shutil.rmtree(result["sandbox"].root, ignore_errors=True)


def tokens(result: dict) -> dict:
    return {r["prompt"]: r["generated_tokens"] for r in result["rows"]}


# CI time (#37): the Ray-alone control and the comparison with it run in test-all; the S3
# control (integrations/test_pipeline.py) shows the same copy, and it is Ray's download, not GCS's.
@pytest.mark.extended
def test_control_without_the_shim_ray_copies_every_weight_from_gcs(control_run, models):
    model, control = models[MODEL], control_run
    [call, *_] = control["sandbox"].engine_calls()
    assert "/snapshots/" in call["model"] and set(model.weights) <= set(call["model_dir_listing"])
    assert call["model_weights"] in (None, "")
    assert len(control["sandbox"].weight_bytes_on_disk(model)) == len(model.weights)


def test_with_the_shim_vllm_streams_from_gcs_and_no_weight_lands_on_disk(shim_run, models, gcs):
    model, shim = models[MODEL], shim_run
    sandbox = shim["sandbox"]
    calls = sandbox.engine_calls()
    assert calls, "vLLM was never reached"
    [snapshot] = sandbox.shim_dirs()
    for call in calls:
        assert call["model"] == str(snapshot) and call["model_weights"] == uri()
        assert call["load_format"] == "runai_streamer"
    assert sandbox.weight_bytes_on_disk(model) == []
    # The weights were read from the bucket by the streamer (ranged media reads), never copied.
    weight_keys = {f"{BUCKET}/llm/{MODEL}/{w}" for w in model.weights}
    assert weight_keys <= set(shim["reads"])
    ranged = [r for r in gcs.requests(shim["mark"]) if r.object_key in weight_keys]
    assert ranged and all(r.status == 206 for r in ranged)
    lines = [ln for ln in shim["worker_logs"].splitlines() if "streams weights from" in ln]
    assert lines and f"streams weights from {uri()}" in lines[0]
    assert len(tokens(shim)) == 4 and all(len(t) > 0 for t in tokens(shim).values())


@pytest.mark.extended
def test_the_same_tokens_streamed_from_gcs_as_from_the_full_copy(shim_run, control_run):
    assert tokens(shim_run) == tokens(control_run)
