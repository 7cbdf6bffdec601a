"""Make Ray 2.45-2.49's pyarrow S3 filesystem reach S3-compatible stores.

Those releases build ``pyarrow.fs.S3FileSystem(anonymous=...)``, and that
constructor ignores ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` and a profile's
``endpoint_url`` (apache/arrow#49643), so MinIO/Ceph/on-prem users cannot reach
the bucket at all. The streamer and boto3 do read those settings, so the shim
makes Ray read the same ones. An endpoint with credentials in it is refused
before any request: no client signs with them, and they would be shown wherever
the URL is.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import ShimError
from ..redact import MASK, has_userinfo, redact_url
from ..tables import schemes, settings
from ..tables.support import split_anonymous


def _profile_endpoint() -> Optional[str]:
    path = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    if not os.path.isfile(path):
        return None
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return None
    section = profile if profile == "default" else f"profile {profile}"
    if not parser.has_section(section):
        return None
    return parser.get(section, "endpoint_url", fallback=None) or None


def _s3_endpoint_settings() -> list[tuple[str, str]]:
    """(where, value) of every S3 endpoint setting in effect, in botocore's order."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return []
    found = [(name, os.environ[name]) for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(name)]
    profile = _profile_endpoint()
    if profile:
        found.append(("the AWS profile's endpoint_url", profile))
    return found


def s3_endpoint() -> Optional[str]:
    """The endpoint boto3 and the streamer would use, in botocore's order."""
    found = _s3_endpoint_settings()
    return found[0][1] if found else None


def gcs_endpoint() -> Optional[str]:
    """The endpoint google-cloud-cpp uses when none is passed: pyarrow's ``GcsFileSystem``
    (what Ray builds, without ``endpoint_override``) and the streamer's C++ GCS backend
    both read ``CLOUD_STORAGE_EMULATOR_ENDPOINT``."""
    return os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT") or None


def _gcs_endpoint_settings() -> list[tuple[str, str]]:
    return [(n, os.environ[n]) for n in ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "STORAGE_EMULATOR_HOST") if os.environ.get(n)]


# --------------------------------------------------------------------------- credentials in an endpoint


def _userinfo_message(where: str, endpoint: str, gcs: bool) -> str:
    url = endpoint if "://" in endpoint else f"https://{endpoint}"
    clean = redact_url(url).replace(f"{MASK}@", "", 1)
    if gcs:
        where_they_go = (
            "The workers' Google identity comes from GOOGLE_APPLICATION_CREDENTIALS (a key file present on "
            "every worker) or their own service account (the node's, or Workload Identity)."
        )
    else:
        where_they_go = (
            "Put the key in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY on the workers (cluster environment or "
            "runtime_env={'env_vars': ...}), or give the workers their own identity (an instance profile, an "
            "IRSA/pod role, AWS_PROFILE)."
        )
    return (
        f"ray-runai-shim: {where} carries credentials in its user-info ({redact_url(url)}). Credentials do not "
        "belong in the endpoint URL: the store clients (pyarrow, the Run:ai streamer) never sign with them but "
        "take them for part of the host name, so every request would fail as an unresolvable host, and the "
        f"URL is shown in logs and on Ray's dashboard. Fix: set {where} to {clean}. {where_they_go}"
    )


def endpoint_credential_problems(scheme: Optional[str] = None) -> list[str]:
    """One message per endpoint setting that holds credentials (for *scheme* only, if given).
    The messages never hold the credentials themselves."""
    out = []
    for gcs, found in ((False, _s3_endpoint_settings()), (True, _gcs_endpoint_settings())):
        if scheme is not None and gcs != (scheme.lower() in schemes.GCS):
            continue
        for where, value in found:
            if has_userinfo(value if "://" in value else f"https://{value}"):
                out.append(_userinfo_message(where, value, gcs))
    return out


def refuse_endpoint_credentials(uri: str) -> None:
    """``ShimError`` before any request when the endpoint *uri*'s store is reached through
    carries credentials: otherwise every fault reads "the host name does not resolve"."""
    scheme = uri.partition("://")[0].lower()
    if scheme not in schemes.S3 + schemes.GCS:
        return
    problems = endpoint_credential_problems(scheme)
    if problems:
        raise ShimError(problems[0])


def _virtual_addressing() -> bool:
    style = os.environ.get("AWS_S3_ADDRESSING_STYLE", "").lower()
    if style:
        return style == "virtual"
    return os.environ.get(settings.STREAMER_VIRTUAL_ADDRESSING, "0") not in ("0", "false", "")


def endpoint_s3_filesystem(anonymous: bool, endpoint: str) -> Any:
    """A pyarrow S3 filesystem for *endpoint*, path-style unless asked otherwise; a
    ``ShimError`` when *endpoint* carries credentials (pyarrow would take them for the host)."""
    import pyarrow.fs as pa_fs

    if has_userinfo(endpoint if "://" in endpoint else f"https://{endpoint}"):
        where = next((w for w, v in _s3_endpoint_settings() if v == endpoint), "the S3 endpoint URL")
        raise ShimError(_userinfo_message(where, endpoint, gcs=False))
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    kwargs: dict[str, Any] = {
        "anonymous": anonymous,
        "endpoint_override": parts.netloc + parts.path.rstrip("/"),
        "scheme": parts.scheme or "https",
        "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "force_virtual_addressing": _virtual_addressing(),
    }
    ca = os.environ.get("AWS_CA_BUNDLE")
    if ca:
        try:
            return pa_fs.S3FileSystem(**kwargs, tls_ca_file_path=ca)
        except TypeError:  # pyarrow < 19 has no per-filesystem CA option
            pass
    return pa_fs.S3FileSystem(**kwargs)


def get_fs_and_path_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for ``CloudFileSystem.get_fs_and_path``."""
    fs, path = wrapped(*args, **kwargs)
    try:
        endpoint = s3_endpoint()
        if endpoint and type(fs).__name__ == "S3FileSystem":
            uri = str(args[0] if args else kwargs.get("object_uri", ""))
            anonymous = split_anonymous(uri)[1]  # the same test Ray applies
            fs = endpoint_s3_filesystem(anonymous, endpoint)
    except ShimError:  # credentials in the endpoint: Ray's own client would fail on them too, less clearly
        raise
    except Exception:  # a shim bug must not break Ray's own access
        from ..log import logger

        logger.warning("ray-runai-shim: could not apply S3 endpoint settings", exc_info=True)
    return fs, path


# --------------------------------------------------------------------------- store identity


@dataclass(frozen=True)
class Store:
    """Which store a filesystem talks to: the same ``s3://bucket/path`` on AWS and on
    a MinIO, or signed and unsigned, must never share a cache entry."""

    scheme: str  # "s3" or "gs"
    endpoint: str  # "http://host:port" without userinfo; "" for the provider's default
    signed: bool
    ignored_env_endpoint: str = ""  # AWS_ENDPOINT_URL set but not used by this filesystem

    @property
    def is_gcs(self) -> bool:
        return self.scheme in schemes.GCS

    def key(self) -> str:
        """Stable text that identifies the store (no secrets in it)."""
        return f"{self.scheme}|{self.endpoint or 'default'}|{'signed' if self.signed else 'unsigned'}"

    def describe(self) -> str:
        """For messages: ``endpoint http://minio:9000`` or the provider's default."""
        if self.endpoint:
            return f"endpoint {self.endpoint}"
        if self.is_gcs:
            return "the default Google Cloud Storage endpoint"
        if self.ignored_env_endpoint:
            return (
                f"the default AWS endpoint (AWS_ENDPOINT_URL={self.ignored_env_endpoint} is set, "
                "but this filesystem does not use it)"
            )
        return "the default AWS endpoint (AWS_ENDPOINT_URL is not set)"


def _fs_options(fs: Any) -> dict[str, Any]:
    """The constructor options of a pyarrow S3/GCS filesystem (they pickle by them).
    They may hold credentials: never log them."""
    if type(fs).__name__ not in ("S3FileSystem", "GcsFileSystem"):
        return {}
    try:
        reduced = fs.__reduce__()
        opts = reduced[1][0] if len(reduced) > 1 and reduced[1] else {}
        return dict(opts) if isinstance(opts, dict) else {}
    except Exception:
        return {}


def _strip_userinfo(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"https://{url}")
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path.rstrip('/')}"


def store_identity(fs: Any, uri: str) -> Store:
    """The store *fs* reaches for *uri*, read off the filesystem itself when it is a
    pyarrow one (what it really connects to), else from the environment."""
    scheme = uri.partition("://")[0].lower() or "s3"
    opts = _fs_options(fs)
    if "anonymous" in opts:
        signed = not opts["anonymous"]
    else:
        signed = not split_anonymous(uri)[1]
    override = str(opts.get("endpoint_override") or "")
    ignored = ""
    if override:
        endpoint = _strip_userinfo(f"{opts.get('scheme') or 'https'}://{override}")
    elif scheme in schemes.GCS:
        env_ep = gcs_endpoint()
        endpoint = _strip_userinfo(env_ep) if env_ep else ""
    elif opts or scheme not in schemes.S3:
        endpoint = ""
        env_ep = s3_endpoint() if scheme in schemes.S3 else None
        ignored = redact_url(env_ep) if env_ep else ""
    else:
        env_ep = s3_endpoint()
        endpoint = _strip_userinfo(env_ep) if env_ep else ""
    return Store(scheme, endpoint, signed, ignored)


#: What names the account a process reads the store as, without any secret in it.
_PRINCIPAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN",
                  "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                  "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "AZURE_CLIENT_ID", "AZURE_STORAGE_ACCOUNT")


def principal() -> str:
    """A fingerprint of the identity this process reads the store as (access key id, profile,
    role, key file: never a secret), so that two tenants sharing one uid and one node never
    share what one of them read. 12 hex digits; the same for the same settings."""
    import hashlib

    text = "\n".join(f"{n}={os.environ.get(n, '')}" for n in _PRINCIPAL_ENV)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
