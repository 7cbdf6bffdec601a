"""``ray-runai-shim doctor``: what a user sees before a job, and the packaging it ships in."""

from __future__ import annotations

import json
import subprocess
import sys
import venv

import pytest
from support.fixtures import BUCKET
from support.procs import base_env

import ray_runai_shim


def doctor_run(s3, *args: str, python: str = sys.executable, **env_extra: str) -> subprocess.CompletedProcess:
    env = base_env({**s3.env(), **env_extra}, site=False)
    return subprocess.run([python, "-m", "ray_runai_shim", "doctor", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def doctor(s3, *args: str, python: str = sys.executable) -> tuple[int, str]:
    p = doctor_run(s3, *args, python=python)
    return p.returncode, p.stdout


def test_doctor_lists_what_would_be_fetched_and_streamed(s3, models):
    model = models["tiny-sharded"]
    code, out = doctor(s3, model.uri, "--json")
    report = json.loads(out)
    assert code == 0
    assert sorted(f["key"] for f in report["model"]["fetch"]) == model.nonweights
    assert sorted(f["key"] for f in report["model"]["stream"]) == model.weights
    assert report["model"]["stream_bytes"] == sum((model.local / w).stat().st_size for w in model.weights)
    assert report["plan"]["ray"] == "2.48.0" and "batch-download" in report["plan"]["patches"]
    assert report["environment"]["AWS_SECRET_ACCESS_KEY"] == "***"
    assert report["model"]["errors"] == [] and report["model"]["warnings"] == []
    code, text = doctor(s3, model.uri)
    assert code == 0 and "streamed by vLLM: 2 files" in text and "verdict: ok" in text


def test_doctor_exits_non_zero_and_says_why_when_a_run_would_fail(s3, models):
    model, client = models["tiny-sharded"], s3.client()
    for rel in model.nonweights:
        if rel != "config.json":
            client.upload_file(str(model.local / rel), BUCKET, f"llm/doc-bad/{rel}")
    client.put_object(Bucket=BUCKET, Key="llm/doc-bad/pytorch_model.bin", Body=b"\0" * 64)
    code, out = doctor(s3, f"s3://{BUCKET}/llm/doc-bad", "--json")
    report = json.loads(out)["model"]
    assert code == 1
    assert any("holds none" in e for e in report["errors"])
    assert any("no config.json" in e for e in report["errors"])
    assert any(".bin checkpoints cannot be streamed" in w for w in report["warnings"])


def test_doctor_refuses_credentials_in_the_endpoint_url_and_never_prints_them(s3, models):
    """#27: with ``http://AKIA:se@cret@host`` doctor printed ``http://***@cret@host``, and the
    listing failed as "the host name does not resolve" against a live store."""
    cases = ((f"http://AKIAFRAGMENT1:secretpart1@secretpart2@127.0.0.1:{s3.port}",
              ("AKIAFRAGMENT1", "secretpart1", "secretpart2")),
             (f"http://AKIA:se@cret@127.0.0.1:{s3.port}", ("se@cret", "cret@", "AKIA:")))
    for endpoint, pieces in cases:
        mark = len(s3.requests())
        for args in ((models["tiny"].uri,), (models["tiny"].uri, "--json"), ()):
            p = doctor_run(s3, *args, AWS_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL_S3=endpoint)
            out = p.stdout + p.stderr
            assert p.returncode == 1, out
            for piece in pieces:
                assert piece not in out, (piece, out)
            assert f"http://***@127.0.0.1:{s3.port}" in out  # the variables, shown masked
            assert "do not belong in the endpoint URL" in out and "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in out
            assert f"to http://127.0.0.1:{s3.port}" in out and "does not resolve" not in out
            if "--json" in args:
                report = json.loads(p.stdout)
                assert len(report["environment_errors"]) == 2  # AWS_ENDPOINT_URL_S3 and AWS_ENDPOINT_URL
                assert any("carries credentials" in e for e in report["model"]["errors"])
        assert s3.requests(mark) == []  # nothing was sent with them


@pytest.mark.parametrize("uri", ["abfss://models@acct.dfs.core.windows.net/llm/tiny?sv=1&sig=SASTOKEN",
                                 "azure://models@acct.blob.core.windows.net/llm/tiny", "az://models/llm/tiny"])
def test_doctor_says_an_azure_source_is_not_streamed_and_how_vllm_would(s3, uri):
    code, out = doctor(s3, uri)
    assert code == 1
    assert "is an Azure source" in out and "az://<container>/<path>" in out and "vLLM >= 0.18" in out
    assert "verdict: NOT STREAMED" in out
    assert "SASTOKEN" not in out and "AWS" not in out.split("\nmodel ", 1)[1]  # no S3 advice for Azure
    _, as_auto = doctor(s3, uri, "--load-format", "auto")
    assert "Azure source" not in as_auto  # nothing to say when streaming is not asked for


def test_doctor_warns_about_stale_shards_outside_the_index(s3, models):
    model, client = models["tiny-sharded"], s3.client()
    for rel in model.nonweights + model.weights:
        client.upload_file(str(model.local / rel), BUCKET, f"llm/doc-stale/{rel}")
    client.upload_file(str(model.local / model.weights[0]), BUCKET, "llm/doc-stale/model-00001-of-00003.safetensors")
    code, out = doctor(s3, f"s3://{BUCKET}/llm/doc-stale", "--json")
    report = json.loads(out)["model"]
    assert code == 0
    assert any("model-00001-of-00003.safetensors" in w for w in report["warnings"])


def test_sdist_and_wheel_install_into_a_clean_venv_and_doctor_runs(built, s3, tmp_path):
    wheels = list(built.glob("*.whl"))
    sdists = list(built.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    import zipfile

    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "ray_runai_shim/py.typed" in names and not any(n.startswith("tests/") for n in names)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheels[0])], check=True, timeout=600)
    p = subprocess.run([str(env_dir / "bin" / "ray-runai-shim"), "doctor", "--json"], capture_output=True,
                       text=True, env=base_env(site=False), timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["versions"]["ray-runai-shim"] == ray_runai_shim.__version__ == "0.2.0" and report["versions"]["ray"] is None
    assert report["plan"]["why"] == "Ray is not installed here"


def test_doctor_says_how_a_submitted_jobs_workers_get_the_shim():
    """In an ``image_uri`` job's entrypoint, doctor says what the ray.init wrapper warns: the image needs
    the package, because Ray combines image_uri only with env_vars."""
    def run(job_env: dict) -> str:
        env = base_env({"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": job_env})}, site=False)
        return subprocess.run([sys.executable, "-m", "ray_runai_shim", "doctor"], env=env, capture_output=True,
                              text=True, timeout=120).stdout

    image = run({"image_uri": "registry.example/llm:1"})
    assert "activation: autoload (submitted job" in image and "pip install ray-runai-shim" in image
    own_hook = run({"working_dir": "gcs://_ray_pkg_x.zip", "worker_process_setup_hook": "mod.hook"})
    assert "under RAY_OVERRIDE_JOB_RUNTIME_ENV=1" in own_hook and "(then mod.hook)" in own_hook
    assert "WARNING" not in own_hook


def test_doctor_shows_this_nodes_relay_and_streamer_memory(s3, monkeypatch):
    monkeypatch.delenv("RUNAI_STREAMER_MEMORY_LIMIT", raising=False)  # the user's own, if any
    p = doctor_run(s3)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and "  readers of the relay's copy: at most 256.0 MiB (or the largest tensor) each" in lines, (
        p.stdout, p.stderr)
    assert any(ln.startswith("  streamer memory per reader: 1 reader(s): ") for ln in lines), p.stdout
    p = doctor_run(s3, RUNAI_STREAMER_MEMORY_LIMIT=str(1 << 30))
    assert "  readers of the relay's copy: set by RUNAI_STREAMER_MEMORY_LIMIT each" in p.stdout.splitlines(), (
        p.stdout, p.stderr)
