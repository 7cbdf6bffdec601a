"""Turn store and local-disk failures into ``ShimError`` messages that name the cause and the fix.

pyarrow reports every store fault as an ``OSError`` whose text is the SDK's
(``AWS Error ACCESS_DENIED during HeadObject``, ``curlCode: 6``,
``google::cloud::Status(PERMISSION_DENIED …)``). Users meet these first on a
worker that lacks credentials the driver has, so each cause gets its own
sentence and fix, in the store's own terms (AWS for ``s3://``, Google Cloud
for ``gs://``), the store's original reason kept at the end. HTTP status classes
(throttling, outages, server errors, gateways, timeouts) get their own cause and
retry advice, whether the store or a proxy in front of it answered. Local disk
faults (full, file too large, name too long) are told apart from store faults
by where they happened, never by guessing from the text.
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from pathlib import Path
from typing import Optional, Union

from ..errors import ShimError
from ..stores.endpoint import Store
from ..tables.settings import CACHE_DIR

#: Causes, in the order they are tested against the store's message.
_S3_PATTERNS: tuple[tuple[str, str], ...] = (
    ("region", r"PermanentRedirect|HTTP status 301|AuthorizationHeaderMalformed|IllegalLocationConstraint"
               r"|region '[^']*' is wrong|expecting '[a-z0-9-]+'|wrong region"),
    ("bad-key", r"INVALID_ACCESS_KEY_ID|InvalidAccessKeyId"),
    ("bad-secret", r"SIGNATURE_DOES_NOT_MATCH|SignatureDoesNotMatch"),
    ("expired", r"EXPIRED_TOKEN|ExpiredToken|InvalidToken|TokenRefreshRequired"),
    ("access", r"ACCESS_DENIED|AccessDenied|HTTP status 403|\b403\b|Forbidden|AllAccessDisabled"),
    ("no-bucket", r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist"),
    ("no-key", r"NO_SUCH_KEY|NoSuchKey|RESOURCE_NOT_FOUND|HTTP status 404"),
    ("dns", r"curlCode: 6\b|[Cc]ould not resolve|[Cc]ouldn't resolve|Name or service not known"
            r"|nodename nor servname|getaddrinfo"),
    ("tls", r"curlCode: (35|51|53|54|58|59|60|64|66|77|80|82|83|90|91)\b|SSL|TLS|certificate"),
    ("connect", r"curlCode: 7\b|[Cc]ould not connect|[Cc]ouldn't connect|Connection refused"),
    ("dropped", r"curlCode: (18|52|55|56)\b|partial file|[Cc]onnection reset|Recv failure|Send failure"),
    # HTTP status classes: the SDK names some by code, others only as "HTTP status N"; a proxy's
    # HTML page (no S3 error code) arrives as REQUEST_TIMEOUT (408/504) or UNKNOWN (502).
    ("throttled", r"SLOW_DOWN|SlowDown|THROTTLING|Throttling|TOO_MANY_REQUESTS|TooManyRequests"
                  r"|RequestLimitExceeded|HTTP status 429|\b429 Too Many Requests"),
    ("unavailable", r"SERVICE_UNAVAILABLE|ServiceUnavailable|HTTP status 503|\b503 Service"),
    ("gateway", r"HTTP status 50[24]|BadGateway|Bad Gateway|GatewayTimeout|Gateway Time-?out"),
    ("timeout", r"curlCode: 28\b|[Tt]imed? ?out|REQUEST_TIMEOUT|HTTP status 408"),
    ("read-refused", r"Failed to flush response stream"),
    # A bare INTERNAL_FAILURE is also what the SDK says when it could not sign (no credentials):
    # only the store's own words or a status make it a server error.
    ("server-error", r"InternalError|Internal Server Error|HTTP status 5\d\d"),
)
_GCS_PATTERNS: tuple[tuple[str, str], ...] = (
    ("gcs-unauthenticated", r"UNAUTHENTICATED|http_status_code=401|Could not (automatically )?determine credentials"),
    ("access", r"PERMISSION_DENIED|http_status_code=403"),
    ("no-bucket", r"[Bb]ucket does not exist|notFound.*bucket|bucket.*NOT_FOUND"),
    ("no-key", r"NOT_FOUND|http_status_code=404|No such object"),
    ("dns", r"CURL error \[6\]|[Cc]ould not resolve|[Cc]ouldn't resolve"),
    ("tls", r"CURL error \[(35|51|53|54|58|59|60|77)\]|SSL|TLS|certificate"),
    ("connect", r"CURL error \[7\]|[Cc]ould not connect|[Cc]ouldn't connect"),
    ("dropped", r"CURL error \[(18|52|55|56)\]|partial file|[Cc]onnection reset"),
    # google-cloud-cpp retries 408/429/5xx and then says UNAVAILABLE or INTERNAL with the last
    # status as http_status_code=N; a proxy's HTML page leaves only its own words.
    ("throttled", r"http_status_code=429|RESOURCE_EXHAUSTED|rateLimitExceeded|\b429 Too Many Requests"),
    ("unavailable", r"http_status_code=503|\b503 Service"),
    ("gateway", r"http_status_code=50[24]|Bad Gateway|Gateway Time-?out"),
    ("timeout", r"CURL error \[28\]|DEADLINE_EXCEEDED|[Tt]imed? ?out|http_status_code=408|\b408 Request Time"),
    ("server-error", r"http_status_code=5\d\d|Internal Server Error|backendError"),
    ("busy", r"UNAVAILABLE|Retry policy exhausted"),
)


def classify_store(message: str, gcs: bool = False) -> str:
    """The cause of a store error from the SDK's message; ``"unknown"`` if none fits."""
    for cause, pattern in _GCS_PATTERNS if gcs else _S3_PATTERNS:
        if re.search(pattern, message):
            return cause
    return "unknown"


def aws_credential_sources() -> list[str]:
    """Where this process could get AWS credentials from (names only, never values)."""
    found = [
        name
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        )
        if os.environ.get(name)
    ]
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    if os.path.isfile(shared):
        found.append(shared)
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        found.append("the instance metadata service (an instance role, if the node has one)")
    return found


def gcs_credential_sources() -> list[str]:
    """Where this process could get Google Cloud credentials from (names only)."""
    found = [n for n in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN") if os.environ.get(n)]
    adc = Path(os.environ.get("CLOUDSDK_CONFIG") or "~/.config/gcloud").expanduser()
    if (adc / "application_default_credentials.json").is_file():
        found.append(str(adc / "application_default_credentials.json"))
    if os.environ.get("NO_GCE_CHECK", "").lower() not in ("1", "true"):
        found.append("the metadata server (the node's service account, if it has one)")
    return found


_NOT_FORWARDED = (
    "The shim never sends the driver's credentials to the workers (by design), so credentials "
    "that work on the driver prove nothing here."
)


def _identity_sentence(store: Store, cause: str, action: str) -> str:
    if not store.signed:
        return (
            "The requests were unsigned (anonymous access, which Ray uses for 'anonymous@' URIs) and "
            "the bucket does not allow that. Drop 'anonymous@' and give the workers credentials."
        )
    sources = gcs_credential_sources() if store.is_gcs else aws_credential_sources()
    if not sources:
        checked = (
            "GOOGLE_APPLICATION_CREDENTIALS, gcloud application-default credentials, metadata server "
            "disabled by NO_GCE_CHECK"
            if store.is_gcs
            else "AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_WEB_IDENTITY_TOKEN_FILE, "
            "AWS_CONTAINER_CREDENTIALS_*, ~/.aws/credentials; instance metadata disabled by "
            "AWS_EC2_METADATA_DISABLED"
        )
        return f"No credentials are visible to this worker process (checked: {checked})."
    said = f"This worker's credentials come from: {', '.join(sources)}."
    if action == "read" and cause == "access":
        missing = "storage.objects.get" if store.is_gcs else "s3:GetObject (and kms:Decrypt for SSE-KMS objects)"
        said += f" That identity could list the prefix but may not read its objects: it lacks {missing}."
    return said


def _give_identity(store: Store) -> str:
    if store.is_gcs:
        return (
            "Fix: give the Ray workers a Google identity with storage.objects.list and "
            "storage.objects.get on the bucket (e.g. roles/storage.objectViewer): the node's or "
            "Workload Identity service account, or GOOGLE_APPLICATION_CREDENTIALS pointing at a key "
            "file present on every worker (cluster environment or runtime_env={'env_vars': …})."
        )
    return (
        "Fix: give the Ray workers an identity with s3:ListBucket on the bucket and s3:GetObject on "
        "the prefix: an instance profile or IRSA/pod-identity role on the worker nodes, a profile in "
        "the image (AWS_PROFILE), or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the cluster's "
        "environment or the job's runtime_env={'env_vars': …}."
    )


def _cause_and_fix(cause: str, store: Store, action: str) -> str:
    where = store.describe()
    if cause in ("access", "gcs-unauthenticated"):
        head = "access denied: the store refused this worker's identity."
        return f"{head} {_identity_sentence(store, cause, action)} {_give_identity(store)} {_NOT_FORWARDED}"
    if cause == "bad-key":
        return (
            "the access key id is unknown to this store (a key for another account or store, or a "
            f"deleted key). {_give_identity(store)} {_NOT_FORWARDED}"
        )
    if cause == "bad-secret":
        return (
            "the secret access key does not match the access key id. Check AWS_SECRET_ACCESS_KEY / "
            f"the profile the workers use. {_NOT_FORWARDED}"
        )
    if cause == "expired":
        return (
            "the session credentials have expired. Workers need credentials that refresh (an "
            f"instance or pod role) or a fresh AWS_SESSION_TOKEN. {_NOT_FORWARDED}"
        )
    if cause == "region":
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "unset"
        return (
            f"wrong region: the bucket lives in another region than the one this worker signs for "
            f"(AWS_REGION/AWS_DEFAULT_REGION={region}). Fix: set AWS_REGION to the bucket's region "
            "on the workers."
        )
    if cause == "no-bucket":
        if store.is_gcs:
            return "no such bucket (or not visible to this identity). Fix: check the bucket name in the gs:// URI."
        return (
            f"no such bucket at {where}. Fix: check the bucket name, and that the endpoint is the store "
            "that holds it (a MinIO/Ceph bucket is not on AWS: set AWS_ENDPOINT_URL on the workers)."
        )
    if cause == "no-key":
        return (
            "the object disappeared between listing and reading: something is changing the prefix. "
            "Fix: rerun once the upload is complete."
        )
    if cause == "dns":
        extra = (
            ""
            if store.is_gcs
            else " With virtual-hosted addressing the bucket is part of the host name: S3-compatible "
            "stores usually need RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0 (or AWS_S3_ADDRESSING_STYLE=path)."
        )
        return f"the host name of {where} does not resolve from this worker. Fix: check the endpoint's host name and the workers' DNS.{extra}"
    if cause == "tls":
        ca = "SSL_CERT_FILE/CURL_CA_BUNDLE" if store.is_gcs else "AWS_CA_BUNDLE"
        return (
            f"the TLS handshake with {where} failed. Fix: for a private CA set {ca} to its PEM bundle "
            "on the workers; for a plain-HTTP endpoint write http:// in the endpoint URL."
        )
    if cause == "connect":
        return (
            f"nothing accepted the connection at {where}. Fix: check the endpoint's host and port and "
            "that the workers can reach it (firewall, proxy, the store is up)."
        )
    if cause == "dropped":
        return (
            f"the connection to {where} broke off mid-transfer. Fix: rerun; if it repeats, check what "
            "sits between the workers and the store (proxies, load balancers and their size or idle limits)."
        )
    retried = "The client already retried with back-off."
    if cause == "throttled":
        said = "429 Too Many Requests, rateLimitExceeded" if store.is_gcs else "429 Too Many Requests / 503 SlowDown"
        raise_limit = "" if store.is_gcs else ", or ask the store's operator for a higher request rate"
        return (
            f"{where} is throttling this client (HTTP {said}: too many requests to this bucket at once). "
            f"{retried} Fix: rerun in a minute; if many replicas or actors start together, start fewer at "
            f"once{raise_limit}."
        )
    if cause == "unavailable":  # also S3's 503 SlowDown when the SDK lost its code (it does on GETs now and then)
        return (
            f"{where} answered 503 Service Unavailable: the store (or the node of it that answered) is down "
            f"or overloaded for now, or is slowing this client down. {retried} Fix: rerun later; if many "
            "replicas or actors start together, start fewer at once; if it persists, check the store's status."
        )
    if cause == "gateway":
        return (
            f"a gateway or proxy between this worker and {where} answered 502/504 (Bad Gateway / Gateway "
            "Timeout): it could not reach the store, or the store did not answer it in time. "
            f"{retried} Fix: rerun; if it repeats, check the proxy or load balancer in front of the store "
            "(its upstream, its timeouts), and that the endpoint URL names the store itself."
        )
    if cause == "timeout":
        return (
            f"the request to {where} timed out (HTTP 408 Request Timeout from the store, 504 Gateway "
            f"Timeout from a proxy in front of it, or no answer at all). {retried} Fix: rerun; if it "
            "repeats, check the path from the workers to the store (firewall, proxy and load-balancer "
            "timeouts) and the store's load."
        )
    if cause == "server-error":
        return (
            f"{where} failed with an internal error (HTTP 500 Internal Server Error): a fault of the "
            f"store, not of this request or its credentials. {retried} Fix: rerun; if it persists, check "
            "the store's health and logs, or ask its operator."
        )
    if cause == "busy":
        return (
            f"{where} kept answering with a transient error until the client's retries ran out "
            "(throttling, an outage, a server or gateway error, or a timeout: the store's words below "
            "say which). Fix: rerun later; if it repeats, check the store's status and any proxy in front of it."
        )
    if cause == "read-refused":
        return (
            "the store refused or cut the object read after accepting the request. Most often the "
            "identity may list but not read objects (s3:GetObject, kms:Decrypt for SSE-KMS); "
            "otherwise the store or a proxy answered the read with an error status (throttling 429/503, "
            "a 5xx) that the client lost on a small object, or the connection dropped: rerun. "
            f"{_identity_sentence(store, 'access', action)} {_NOT_FORWARDED}"
        )
    # Unknown: the store's words, plus the credential state when it is the likely culprit.
    sources = gcs_credential_sources() if store.is_gcs else aws_credential_sources()
    if store.signed and not sources:
        return (
            f"the store refused the request. {_identity_sentence(store, cause, action)} "
            f"{_give_identity(store)} {_NOT_FORWARDED}"
        )
    if store.is_gcs:
        return (
            "the store gave no reason this shim recognises. Check the bucket name and the credentials "
            "the workers see (GOOGLE_APPLICATION_CREDENTIALS, the node's service account)."
        )
    return (
        "the store gave no reason this shim recognises. Check the bucket name, the credentials the "
        "workers see (AWS_ACCESS_KEY_ID/AWS_PROFILE/instance role) and, for S3-compatible stores, "
        "AWS_ENDPOINT_URL."
    )


def store_error(
    exc: BaseException, *, uri: str, store: Store, action: str, cause: Optional[str] = None
) -> ShimError:
    """A ``ShimError`` for a failed store call. *action* is ``"list"`` or ``"read"``;
    *uri* the prefix or object that failed; *cause* when the caller knows it better than
    the message does."""
    reason = str(exc).strip() or type(exc).__name__
    cause = cause or classify_store(reason, gcs=store.is_gcs)
    if cause == "unknown" and "INTERNAL_FAILURE" in reason and (not store.signed or aws_credential_sources()):
        cause = "server-error"  # the SDK's bare word for a 500 without an S3 code, once it could sign
    verb = "list" if action == "list" else "read"
    return ShimError(
        f"ray-runai-shim: cannot {verb} {uri} via {store.describe()}: "
        f"{_cause_and_fix(cause, store, action)} (store said: {reason})"
    )


#: errno -> (cause, fix) for local writes. ``{path}`` and ``{var}`` are filled in.
_LOCAL: dict[int, tuple[str, str]] = {
    errno_mod.ENOSPC: ("the disk holding {path} is full",
                       "free space there, or set {var} to a directory on a disk with room"),
    errno_mod.EDQUOT: ("this user's disk quota is exhausted on {path}",
                       "free space in the quota, or set {var} to a directory on another disk"),
    errno_mod.EFBIG: ("a file is larger than this process or filesystem allows (ulimit -f / "
                      "RLIMIT_FSIZE, or the filesystem's file-size limit)",
                      "raise the file-size limit of the Ray worker processes, or set {var} to another filesystem"),
    errno_mod.ENAMETOOLONG: ("an object key maps to a local name longer than this filesystem allows",
                             "shorten that object's key in the bucket, or set {var} to a shorter path"),
    errno_mod.EACCES: ("this user (uid {uid}) may not write there",
                       "make it writable for the Ray workers' user, or set {var} to a directory they own"),
    errno_mod.EPERM: ("this user (uid {uid}) may not write there",
                      "make it writable for the Ray workers' user, or set {var} to a directory they own"),
    errno_mod.EROFS: ("the filesystem is read-only", "set {var} to a writable directory"),
    errno_mod.ELOOP: ("a symbolic link was found where the shim writes, and it never writes through one",
                      "remove the link; if others can write to the cache, set {var} to a private directory"),
    errno_mod.EIO: ("the local disk reported an I/O error", "check the disk, or set {var} to another one"),
}


def local_error(exc: OSError, *, path: Union[str, Path, None], uri: str, nbytes: Optional[int] = None) -> ShimError:
    """A ``ShimError`` for a failed local write while materialising *uri*."""
    code = exc.errno or 0
    name = errno_mod.errorcode.get(code, f"errno {code}")
    where = str(path or exc.filename or "the cache directory")
    cause, fix = _LOCAL.get(
        code, ("the local write failed", "check the disk, or set {var} to another directory")
    )
    fmt = {"path": where, "var": CACHE_DIR, "uid": os.getuid() if hasattr(os, "getuid") else "?"}
    size = ""
    if nbytes is not None and code in (errno_mod.ENOSPC, errno_mod.EDQUOT):
        from ..log import human_bytes

        size = f" (this model's non-weight files need {human_bytes(nbytes)})"
    return ShimError(
        f"ray-runai-shim: cannot write the non-weight files of {uri} to {where}: [{name}] "
        f"{exc.strerror or exc}. Cause: {cause.format(**fmt)}. Fix: {fix.format(**fmt)}{size}. "
        "Nothing was left behind."
    )
