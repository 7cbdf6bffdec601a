"""Store and local faults become ShimErrors that name the cause and the fix, in the store's terms.

Real pyarrow clients talk to real servers on loopback: moto where it can play the
part, small fakes (``support/fakestores.py``) for what moto cannot do (a bucket in
another region, an expired token, HEAD allowed but GET refused, Google Cloud Storage).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest
from support.fakestores import FakeGcs, FakeS3

from ray_runai_shim.diagnostics.diagnose import classify_store, local_error
from ray_runai_shim.errors import ShimError
from ray_runai_shim.snapshot import cache
from ray_runai_shim.snapshot.fetch import MANIFEST, fetch_nonweights, list_model
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem


@pytest.fixture
def aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATESTDIAGNOSE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "diagnose-secret-value")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


def s3_fs(endpoint: str):
    return lambda uri: (endpoint_s3_filesystem(False, endpoint), uri.split("://", 1)[1])


def shim_error(fn) -> str:
    with pytest.raises(ShimError) as err:
        fn()
    return str(err.value)


# --------------------------------------------------------------------------- S3


@pytest.mark.parametrize(
    "status,code,message",
    [
        (301, "PermanentRedirect", "The bucket you are attempting to access must be addressed using the specified endpoint."),
        (400, "AuthorizationHeaderMalformed", "The authorization header is malformed; the region 'us-east-1' is wrong; expecting 'eu-west-1'"),
    ],
)
def test_a_bucket_in_another_region_is_named_with_the_variable_to_set(aws_env, tmp_path, status, code, message):
    fake = FakeS3(status, code, message)
    try:
        msg = shim_error(lambda: fetch_nonweights("s3://bkt/m", "runai_streamer", fs_and_path=s3_fs(fake.endpoint),
                                                  root=tmp_path))
    finally:
        fake.close()
    assert "wrong region" in msg and "AWS_REGION/AWS_DEFAULT_REGION=us-east-1" in msg and "set AWS_REGION" in msg
    assert code in msg and "diagnose-secret-value" not in msg


def test_an_expired_session_token_is_named(aws_env, tmp_path):
    fake = FakeS3(400, "ExpiredToken", "The provided token has expired.")
    try:
        msg = shim_error(lambda: list_model("s3://bkt/m", s3_fs(fake.endpoint)))
    finally:
        fake.close()
    assert "session credentials have expired" in msg and "ExpiredToken" in msg


def test_get_refused_after_head_is_not_left_as_an_internal_failure(aws_env, tmp_path):
    fake = FakeS3(403, "AccessDenied", "Access Denied", keys={"m/config.json": 2, "m/model.safetensors": 8})
    try:
        msg = shim_error(lambda: fetch_nonweights("s3://bkt/m", "runai_streamer", fs_and_path=s3_fs(fake.endpoint),
                                                  root=tmp_path))
        methods = [m for m, _ in fake.requests]
    finally:
        fake.close()
    assert methods.count("HEAD") >= 1 and "GET" in methods  # listed, HEAD fine, then the GET refused
    said = msg.split("(store said: ", 1)[1]
    # Control: pyarrow's own text names neither the 403 nor a permission.
    assert "Failed to flush response stream" in said and "403" not in said and "denied" not in said.lower()
    assert "s3://bkt/m/config.json" in msg and "refused or cut the object read" in msg and "s3:GetObject" in msg
    assert "AWS_ACCESS_KEY_ID" in msg  # where this worker's identity comes from (the name, never the value)
    assert "AKIATESTDIAGNOSE" not in msg and "diagnose-secret-value" not in msg
    assert not any(p.is_dir() and not p.name.startswith(".") for p in (tmp_path / cache.DIR_NAME).iterdir())


def test_an_unresolvable_endpoint_names_dns_and_addressing(aws_env):
    msg = shim_error(lambda: list_model("s3://bkt/m", s3_fs("http://no-such-host.invalid:9000")))
    assert "does not resolve" in msg and "http://no-such-host.invalid:9000" in msg
    assert "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0" in msg and "curlCode: 6" in msg


def test_tls_to_a_plain_http_endpoint_names_the_ca_bundle_and_the_scheme(aws_env, s3):
    endpoint = f"https://127.0.0.1:{s3.port}"  # moto speaks plain HTTP: the handshake fails
    msg = shim_error(lambda: list_model("s3://models/llm/tiny", s3_fs(endpoint)))
    assert "TLS handshake" in msg and endpoint in msg and "AWS_CA_BUNDLE" in msg and "http://" in msg


def test_a_refused_connection_is_not_blamed_on_credentials(aws_env):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    msg = shim_error(lambda: list_model("s3://bkt/m", s3_fs(dead)))
    cause = msg.split("(store said:")[0]
    assert "nothing accepted the connection" in cause and "credentials" not in cause


@pytest.mark.parametrize(
    "text,cause",
    [
        ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", "access"),
        ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation: The specified bucket does not exist", "no-bucket"),
        ("AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 7, Could not connect to server", "connect"),
        ("AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 28, Timeout was reached", "timeout"),
        ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 60, SSL peer certificate or SSH remote key was not OK", "tls"),
        ("AWS Error SIGNATURE_DOES_NOT_MATCH during ListObjectsV2 operation: The request signature …", "bad-secret"),
        ("AWS Error INTERNAL_FAILURE during ListObjectsV2 operation: ", "unknown"),  # no S3 code: a 500, or no credentials to sign with (store_error tells)
        ("AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response stream (eof: 0, bad: 1)",
         "read-refused"),
        ("AWS Error UNKNOWN (HTTP status 502) during ListObjectsV2 operation: ", "gateway"),
        ("AWS Error REQUEST_TIMEOUT during GetObject operation: ", "timeout"),
        ("AWS Error UNKNOWN (HTTP status 429) during GetObject operation: No response body.", "throttled"),
        ("AWS Error SERVICE_UNAVAILABLE during ListObjectsV2 operation: ", "unavailable"),
        ("AWS Error UNKNOWN (HTTP status 418) during ListObjectsV2 operation: ", "unknown"),
    ],
)
def test_s3_causes_from_the_sdks_words(text, cause):
    assert classify_store(text) == cause


def nginx_page(code: int, phrase: str) -> bytes:
    """What nginx in front of a store answers by itself (no S3 or GCS error in it)."""
    return (f"<html>\r\n<head><title>{code} {phrase}</title></head>\r\n<body>\r\n<center><h1>{code} {phrase}"
            "</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n").encode()


RETRIED = "The client already retried with back-off."
CAUSE_AND_FIX = {
    "throttled": ("is throttling this client", RETRIED, "Fix: rerun in a minute", "start fewer at once"),
    "unavailable": ("answered 503 Service Unavailable", RETRIED, "Fix: rerun later", "start fewer at once",
                    "the store's status"),
    "server-error": ("failed with an internal error", "not of this request or its credentials", RETRIED,
                     "Fix: rerun; if it persists, check the store's health and logs"),
    "gateway": ("a gateway or proxy between this worker and", "502/504", RETRIED,
                "check the proxy or load balancer in front of the store"),
    "timeout": ("timed out (HTTP 408 Request Timeout from the store, 504 Gateway Timeout from a proxy", RETRIED,
                "Fix: rerun", "load-balancer timeouts"),
}
S3_STATUS_CASES = [
    pytest.param(429, {"code": "SlowDown", "message": "Please reduce your request rate."}, "throttled", id="429-SlowDown"),
    pytest.param(429, {"body": b""}, "throttled", id="429-no-body"),
    # The SDK now and then loses the SlowDown code of a GET's 503 (timing) and says SERVICE_UNAVAILABLE.
    pytest.param(503, {"code": "SlowDown", "message": "Please reduce your request rate."}, ("throttled", "unavailable"),
                 id="503-SlowDown"),
    pytest.param(503, {"body": nginx_page(503, "Service Temporarily Unavailable")}, "unavailable", id="503-proxy-page"),
    pytest.param(500, {"code": "InternalError", "message": "We encountered an internal error. Please try again."},
                 "server-error", id="500-InternalError"),
    pytest.param(500, {"body": nginx_page(500, "Internal Server Error")}, "server-error", id="500-proxy-page"),
    pytest.param(502, {"body": nginx_page(502, "Bad Gateway")}, "gateway", id="502-proxy-page"),
    pytest.param(504, {"body": b""}, "gateway", id="504-no-body"),
    pytest.param(504, {"body": nginx_page(504, "Gateway Time-out")}, "timeout", id="504-proxy-page"),  # the SDK: REQUEST_TIMEOUT
    pytest.param(408, {"code": "RequestTimeout", "message": "Your socket connection to the server was not read from "
                       "or written to within the timeout period."}, "timeout", id="408-RequestTimeout"),
]


@pytest.mark.parametrize("action", ["list", "read"])
@pytest.mark.parametrize("status,answer,cause", S3_STATUS_CASES)
def test_s3_and_proxy_status_classes_name_their_cause_and_fix(aws_env, monkeypatch, tmp_path, status, answer, cause,
                                                               action):
    """A fault server as AWS_ENDPOINT_URL answers the listing (or, after listing and HEAD, the
    object GET) with *status*. Before #27, 500, 502, 504 and a 429 without an S3 code read "the
    store gave no reason this shim recognises. Check the bucket name, the credentials …"; a 503
    page "is throttling or temporarily unavailable" like SlowDown; 408 "did not answer in time"."""
    from ray_runai_shim.stores.endpoint import s3_endpoint

    keys = {"m/config.json": 5000, "m/model.safetensors": 64} if action == "read" else None  # > any error body
    fake = FakeS3(status, keys=keys, **answer)
    monkeypatch.setenv("AWS_ENDPOINT_URL", fake.endpoint)
    fsp = lambda uri: (endpoint_s3_filesystem(False, s3_endpoint()), uri.split("://", 1)[1])  # noqa: E731
    try:
        msg = shim_error(lambda: fetch_nonweights("s3://bkt/m", "runai_streamer", fs_and_path=fsp, root=tmp_path))
        methods = [m for m, _ in fake.requests]
    finally:
        fake.close()
    if action == "read":
        assert "HEAD" in methods and methods[-1] == "GET"  # listed and probed fine; the object read failed
    target = "s3://bkt/m/config.json" if action == "read" else "s3://bkt/m"
    assert f"cannot {action} {target} via endpoint {fake.endpoint}: " in msg
    # What the user reads: the words of one of the expected causes (the SDK's bare INTERNAL_FAILURE
    # is told apart from "no credentials" by the worker's credentials, not by the text alone).
    named = [c for c in (cause if isinstance(cause, tuple) else (cause,)) if all(w in msg for w in CAUSE_AND_FIX[c])]
    assert named, msg
    got = named[0]
    for words in CAUSE_AND_FIX[got]:
        assert words in msg, (words, msg)
    assert "no reason this shim recognises" not in msg and "AKIATESTDIAGNOSE" not in msg
    assert not [p for p in tmp_path.rglob("*") if p.is_dir() and not p.name.startswith(".")
                and p.name != cache.DIR_NAME]  # no snapshot left behind


def test_ray_s_own_filesystem_lookup_refuses_an_endpoint_with_credentials(aws_env, monkeypatch):
    """The wrapper on Ray's ``get_fs_and_path`` let any error fall back to Ray's filesystem, which
    on 2.45-2.49 goes to AWS itself: the user-info error must reach the user instead."""
    import pyarrow.fs as pa_fs

    from ray_runai_shim.stores.endpoint import get_fs_and_path_wrapper

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://AKIA:se@cret@127.0.0.1:9")
    ray_s = lambda uri: (pa_fs.S3FileSystem(anonymous=True), uri.split("://", 1)[1])  # noqa: E731
    with pytest.raises(ShimError) as err:
        get_fs_and_path_wrapper(ray_s, None, ("s3://bkt/m",), {})
    msg = str(err.value)
    assert "AWS_ENDPOINT_URL carries credentials" in msg and "se@cret" not in msg and "cret@" not in msg
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # control: without user-info, the endpoint's fs
    fs, _ = get_fs_and_path_wrapper(ray_s, None, ("s3://bkt/m",), {})
    assert type(fs).__name__ == "S3FileSystem" and fs.__reduce__()[1][0]["endpoint_override"] == "127.0.0.1:9"


def test_endpoint_credentials_in_an_aws_profile_and_what_is_left_alone(aws_env, monkeypatch, tmp_path):
    from ray_runai_shim.snapshot.fetch import check_source
    from ray_runai_shim.stores.endpoint import endpoint_credential_problems, refuse_endpoint_credentials

    config = tmp_path / "config"
    config.write_text("[profile minio]\nendpoint_url = http://AKIAPROFILE:profile-pw@rd@minio:9000\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "minio")
    [problem] = endpoint_credential_problems("s3")
    assert "the AWS profile's endpoint_url carries credentials" in problem
    assert "set the AWS profile's endpoint_url to http://minio:9000" in problem
    assert "AKIAPROFILE" not in problem and "profile-pw" not in problem and "rd@" not in problem
    with pytest.raises(ShimError):
        refuse_endpoint_credentials("s3://bkt/m")
    # Not S3's business: a gs:// source, and Azure's container@account form (not user-info).
    assert endpoint_credential_problems("gs") == []
    refuse_endpoint_credentials("gs://bkt/m")
    refuse_endpoint_credentials("abfss://models@acct.dfs.core.windows.net/llm/tiny")
    check_source("abfss://models@acct.dfs.core.windows.net/llm//tiny")
    check_source("s3://anonymous@bkt/llm/tiny/")  # Ray's unsigned form and a trailing "/" are fine


# --------------------------------------------------------------------------- GCS


def test_a_gcs_emulator_endpoint_with_credentials_is_refused_before_any_request(monkeypatch):
    fake = FakeGcs("bkt")
    fake.put("m/config.json", b"{}")
    monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", f"http://svc:gcs-pw@x@{fake.endpoint}")
    try:
        msg = shim_error(lambda: list_model("gs://bkt/m", lambda uri: (fake.filesystem(), "bkt/m")))
        requests = list(fake.requests)
    finally:
        fake.close()
    assert requests == []
    assert "CLOUD_STORAGE_EMULATOR_ENDPOINT carries credentials" in msg and f"to http://{fake.endpoint}" in msg
    assert "GOOGLE_APPLICATION_CREDENTIALS" in msg and "AWS" not in msg
    assert "gcs-pw" not in msg and "svc:" not in msg


@pytest.mark.parametrize(
    "status,reason,message,expect",
    [
        (403, "forbidden", "Caller does not have storage.objects.list access to the Google Cloud Storage bucket.",
         "access denied"),
        (401, "required", "Anonymous caller does not have storage.objects.list access", "access denied"),
        (404, "notFound", "The specified bucket does not exist.", "no such bucket"),
    ],
)
def test_gcs_errors_are_told_in_google_cloud_terms(status, reason, message, expect, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASHOULDNOTMATTER")
    fake = FakeGcs("bkt")
    fake.error = (status, reason, message)
    try:
        msg = shim_error(lambda: list_model("gs://bkt/m", lambda uri: (fake.filesystem(), "bkt/m")))
    finally:
        fake.close()
    assert expect in msg and "gs://bkt/m" in msg and f"endpoint http://{fake.endpoint}" in msg
    assert "AWS" not in msg and "s3:" not in msg  # never described with AWS variables
    if expect == "access denied":
        assert "storage.objects.get" in msg and "GOOGLE_APPLICATION_CREDENTIALS" in msg and "Workload Identity" in msg
        assert "unsigned" in msg  # this client was anonymous, and the message says so


@pytest.mark.parametrize(
    "status,page,cause",
    [
        (429, None, "throttled"),
        (503, None, "unavailable"),
        (500, None, "server-error"),
        (502, None, "gateway"),
        (504, None, "gateway"),
        (408, None, "timeout"),
        (502, nginx_page(502, "Bad Gateway"), "gateway"),
        (504, nginx_page(504, "Gateway Time-out"), "gateway"),
        (429, nginx_page(429, "Too Many Requests"), "throttled"),
    ],
)
def test_gcs_status_classes_in_google_cloud_terms(status, page, cause):
    """google-cloud-cpp retries these, then says UNAVAILABLE (INTERNAL for 504) for all of them:
    before #27 every one read "is throttling or temporarily unavailable" (504: "no reason")."""
    fake = FakeGcs("bkt")
    if page is None:
        fake.error = (status, "rateLimitExceeded" if status == 429 else "backendError", "the backend said no")
    else:
        fake.page = (status, page)  # a proxy's own page: no http_status_code in the client's words
    try:
        msg = shim_error(lambda: list_model("gs://bkt/m", lambda uri: (fake.filesystem(), "bkt/m")))
    finally:
        fake.close()
    assert classify_store(msg.split("(store said: ", 1)[1], gcs=True) == cause
    for words in CAUSE_AND_FIX[cause]:
        assert words in msg, (words, msg)
    assert "gs://bkt/m" in msg and "AWS" not in msg and "SlowDown" not in msg  # Google Cloud terms only


def test_gcs_connection_refused_in_google_cloud_terms():
    import datetime

    import pyarrow.fs as pa_fs

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    fs = pa_fs.GcsFileSystem(anonymous=True, endpoint_override=f"127.0.0.1:{port}", scheme="http",
                             retry_time_limit=datetime.timedelta(seconds=1))
    msg = shim_error(lambda: list_model("gs://bkt/m", lambda uri: (fs, "bkt/m")))
    assert "nothing accepted the connection" in msg and "AWS" not in msg


def test_gcs_reuse_is_decided_by_the_object_generation(tmp_path):
    fake = FakeGcs("bkt")
    a, b = b'{"temperature": 0.1}', b'{"temperature": 0.9}'
    for name, data in {"m/config.json": b'{"model_type": "llama"}', "m/generation_config.json": a,
                       "m/model.safetensors": b"\0" * 64}.items():
        fake.put(name, data)
    fsp = lambda uri: (fake.filesystem(), "bkt/m")  # noqa: E731
    try:
        first = fetch_nonweights("gs://bkt/m", "runai_streamer", fs_and_path=fsp, root=tmp_path)
        again = fetch_nonweights("gs://bkt/m", "runai_streamer", fs_and_path=fsp, root=tmp_path)
        fake.put("m/generation_config.json", b)  # same size, new generation
        third = fetch_nonweights("gs://bkt/m", "runai_streamer", fs_and_path=fsp, root=tmp_path)
        media = [p for m, p in fake.requests if "alt=media" in p and "model.safetensors" in p]
    finally:
        fake.close()
    assert again.reused and again.local_dir == first.local_dir
    assert not third.reused and (Path(third.local_dir) / "generation_config.json").read_bytes() == b
    ids = json.loads((Path(third.local_dir) / MANIFEST).read_text())["files"]
    assert all(v["id"].startswith("generation:") for v in ids.values())
    assert media == []  # the weights were never read
    assert json.loads((Path(first.local_dir) / MANIFEST).read_text())["store"] == f"gs|http://{fake.endpoint}|unsigned"


# --------------------------------------------------------------------------- local disk


@pytest.mark.parametrize(
    "code,words",
    [
        (errno.ENOSPC, "is full"),
        (errno.EDQUOT, "quota"),
        (errno.EFBIG, "RLIMIT_FSIZE"),
        (errno.ENAMETOOLONG, "longer than this filesystem allows"),
        (errno.EACCES, f"(uid {os.getuid()}) may not write"),
        (errno.EROFS, "read-only"),
    ],
)
def test_local_faults_name_the_path_the_errno_and_the_fix(code, words):
    path = "/cache/ray-runai-shim/.staging-x/tokenizer.json"
    msg = str(local_error(OSError(code, os.strerror(code)), path=path, uri="s3://b/m", nbytes=5 << 20))
    assert path in msg and errno.errorcode[code] in msg and words in msg
    assert "RAY_RUNAI_SHIM_CACHE_DIR" in msg and "reachable" not in msg and "store" not in msg
    if code == errno.ENOSPC:
        assert "need 5.0 MiB" in msg
