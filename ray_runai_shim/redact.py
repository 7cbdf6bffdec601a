"""Keep secrets out of everything the shim prints, logs or forwards.

Errors travel far (Ray's task errors, the dashboard, bug reports), and an
endpoint such as ``http://KEY:SECRET@minio:9000`` or a presigned query string
carries credentials in plain text. Every ``ShimError`` message passes through
:func:`redact_text`; ``doctor`` and the runtime_env forwarding use
:func:`redact_env` / :func:`forwardable`. Stdlib only: errors import it early.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Optional

MASK = "***"

#: Userinfo ("user:password@") right after a URL scheme. ``anonymous@`` is Ray's
#: spelling of unsigned access, not a secret, and is kept so messages stay exact.
#: A password may hold "/" (AWS secrets do); a user name may not, so keys like
#: ``s3://bucket/a@b.txt`` are left alone. A secret may also hold an unencoded "@":
#: the userinfo runs to the LAST "@" before the host (URL parsers and curl agree), so
#: ``http://AKIA:se@cret@host`` loses all of ``AKIA:se@cret``, not just ``AKIA:se``.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)"
    r"(?P<userinfo>[^/\s@'\"<>:]+(?::[^\s@'\"<>]*)?(?:@[^/?#\s@'\"<>]*(?=@))*)@"
)
#: Credentials in query strings (presigned S3/GCS URLs, OAuth tokens).
_QUERY_SECRET = re.compile(
    r"(?i)\b(?P<name>x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
    r"x-goog-credential|awsaccesskeyid|signature|access_token|token|sig)=(?P<value>[^&\s'\"]+)"
)
#: Environment variables that hold secrets by name (values are masked wherever they appear).
SECRET_NAMES: frozenset[str] = frozenset(
    {
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "GOOGLE_OAUTH_ACCESS_TOKEN",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
    }
)
_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL")
_NOT_SECRET_SUFFIXES = ("_FILE", "_PATH", "_DIR", "_URI", "_EXPIRATION")
_MIN_SECRET_LEN = 6  # shorter values would mask ordinary words


def is_secret_name(name: str) -> bool:
    """True for variables whose value is a secret (paths to secret files are not)."""
    upper = name.upper()
    if upper in SECRET_NAMES:
        return True
    if upper == "GOOGLE_APPLICATION_CREDENTIALS" or upper.endswith(_NOT_SECRET_SUFFIXES):
        return False
    return any(word in upper for word in _SECRET_WORDS)


def has_userinfo(value: str) -> bool:
    """True when *value* contains a URL with credentials in it (``scheme://user:pw@host``)."""
    return any(m["userinfo"] != "anonymous" for m in _USERINFO.finditer(value))


def redact_url(url: str) -> str:
    """*url* with any userinfo replaced by ``***`` (``anonymous@`` kept)."""
    return redact_text(url, env=False)


def shown_uri(uri: str) -> str:
    """A model URI fit for a message: no userinfo and no query (a SAS-style token)."""
    return redact_url(uri.split("?", 1)[0])


def _secret_values(environ: Mapping[str, str]) -> list[str]:
    """Secret values of *environ*: secret variables, and the userinfo (and its password)
    of any URL in any variable, which SDK messages may quote without the scheme."""
    values = {v for k, v in environ.items() if v and is_secret_name(k)}
    for v in environ.values():
        if "://" in v and "@" in v:
            for m in _USERINFO.finditer(v):
                if m["userinfo"] != "anonymous":
                    user, _, password = m["userinfo"].partition(":")
                    values.update((m["userinfo"], user, password, *password.split("@")))
    values = {v for v in values if len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)  # longest first: one may contain another


def redact_text(text: str, env: bool = True, environ: Optional[Mapping[str, str]] = None) -> str:
    """Mask URL userinfo, credential query parameters and (with *env*) the values of
    secret environment variables of this process wherever they occur in *text*."""

    def _userinfo(m: re.Match[str]) -> str:
        return m.group(0) if m["userinfo"] == "anonymous" else f"{m['scheme']}{MASK}@"

    out = _USERINFO.sub(_userinfo, text)
    out = _QUERY_SECRET.sub(lambda m: f"{m['name']}={MASK}", out)
    if env:
        for value in _secret_values(os.environ if environ is None else environ):
            out = out.replace(value, MASK)
    return out


def redact_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy fit for display: secret variables masked, URL userinfo masked in the rest."""
    return {k: (MASK if is_secret_name(k) else redact_text(v, env=False)) for k, v in environ.items()}


def forwardable(name: str, value: str) -> bool:
    """Whether *name=value* may be copied into a job's runtime_env (visible on Ray's
    dashboard): never a secret variable, never a URL with credentials in it."""
    return not is_secret_name(name) and not has_userinfo(value)
