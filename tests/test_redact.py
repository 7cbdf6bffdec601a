"""Secrets never appear in errors, logs, doctor output or a forwarded runtime_env."""

from __future__ import annotations

import pickle

import pytest

from ray_runai_shim.errors import ShimError
from ray_runai_shim.redact import (
    MASK,
    forwardable,
    has_userinfo,
    redact_env,
    redact_text,
    redact_url,
)


@pytest.mark.parametrize(
    "raw,redacted",
    [
        ("http://KEY:SECRET@minio:9000", "http://***@minio:9000"),
        ("via endpoint https://user:p%40ss@host/path?x=1", "via endpoint https://***@host/path?x=1"),
        ("s3://AKIA1:abc/def@bucket/model", "s3://***@bucket/model"),
        # An unencoded "@" in the secret: the userinfo runs to the last "@" before the host.
        ("http://AKIA:se@cret@127.0.0.1:9000", "http://***@127.0.0.1:9000"),
        ("s3://AKIA1:ab/c@d@bucket/model", "s3://***@bucket/model"),
        ("endpoint http://k:pw@minio:9000/llm/a@b.txt", "endpoint http://***@minio:9000/llm/a@b.txt"),  # path kept
        ("s3://anonymous@public-bucket/m", "s3://anonymous@public-bucket/m"),  # Ray's unsigned form, kept
        ("https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA%2F1&x=1",
         "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***&x=1"),
        ("no url here: tokenizer.json, config.json", "no url here: tokenizer.json, config.json"),
    ],
)
def test_urls_with_credentials_are_masked(raw, redacted):
    assert redact_text(raw, env=False) == redacted
    assert redact_text(redacted, env=False) == redacted  # idempotent


def test_values_of_secret_variables_and_url_userinfo_in_the_environment_are_masked():
    env = {
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG",
        "AWS_SESSION_TOKEN": "FQoGZXIvYXdzEJr",
        "AWS_ENDPOINT_URL": "http://AKIAENDPOINT:endpoint-pw-77@minio:9000",
        "AWS_REGION": "us-east-1",
        "GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/key.json",
    }
    text = ("secret wJalrXUtnFEMI/K7MDENG token FQoGZXIvYXdzEJr sdk said: could not connect to "
            "AKIAENDPOINT:endpoint-pw-77@minio port 9000; password endpoint-pw-77; region us-east-1; "
            "key file /var/secrets/key.json")
    out = redact_text(text, environ=env)
    for secret in ("wJalrXUtnFEMI/K7MDENG", "FQoGZXIvYXdzEJr", "endpoint-pw-77"):
        assert secret not in out
    assert "us-east-1" in out and "/var/secrets/key.json" in out  # not secrets: kept


def test_shim_errors_are_redacted_at_construction_and_after_pickling(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-secret-access-key")
    err = ShimError("cannot list s3://b/m via endpoint http://k:pw-value@h:9000: key the-secret-access-key")
    assert "pw-value" not in str(err) and "the-secret-access-key" not in str(err)
    assert str(err).count(MASK) == 2
    again = pickle.loads(pickle.dumps(err))  # how Ray carries it to the driver
    assert str(again) == str(err) and isinstance(again, ValueError)


def test_what_doctor_shows_and_what_may_be_forwarded():
    env = {"AWS_ENDPOINT_URL": "http://KEY:SECRET@minio:9000", "AWS_SECRET_ACCESS_KEY": "x" * 20,
           "RUNAI_STREAMER_CONCURRENCY": "16", "HF_TOKEN": "hf_abcdefgh"}
    shown = redact_env(env)
    assert shown == {"AWS_ENDPOINT_URL": "http://***@minio:9000", "AWS_SECRET_ACCESS_KEY": MASK,
                     "RUNAI_STREAMER_CONCURRENCY": "16", "HF_TOKEN": MASK}
    assert not forwardable("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])  # would show on the dashboard
    assert forwardable("AWS_ENDPOINT_URL", "http://minio:9000")
    assert not forwardable("AWS_SESSION_TOKEN", "abc")
    assert has_userinfo("https://u:p@h") and not has_userinfo("s3://anonymous@b/m")
    assert redact_url("https://u:p@h:1/x") == "https://***@h:1/x"


def test_no_fragment_of_a_secret_with_at_signs_survives():
    """Before #27 the mask stopped at the first "@": ``http://***@cret@127.0.0.1:9000`` (and
    doctor printed the tail)."""
    url = "http://AKIAFRAGMENT1:secretpart1@secretpart2@@secretpart3@127.0.0.1:9000/p"
    env = {"AWS_ENDPOINT_URL": url}
    quoted = "curl: Could not resolve host: AKIAFRAGMENT1:secretpart1@secretpart2@@secretpart3@127.0.0.1"
    for out in (redact_url(url), redact_text(url, env=False), redact_text(f"via {url}: {quoted}", environ=env),
                redact_env(env)["AWS_ENDPOINT_URL"]):
        for piece in ("AKIAFRAGMENT1", "secretpart1", "secretpart2", "secretpart3"):
            assert piece not in out, out
    assert redact_url(url) == "http://***@127.0.0.1:9000/p"
    assert has_userinfo(url) and not forwardable("AWS_ENDPOINT_URL", url)
