"""Every URI scheme the shim tells apart, and one case rule.

The rule: the shim's own decisions read a scheme in any case (``S3://`` is ``s3://``), as
the stores' SDKs and vLLM's ``is_cloud_storage`` do. Where the shim mirrors an upstream check
to predict what Ray will do, it keeps that check's own rule and says so at the function:
Ray 2.45-2.51's ``is_remote_path`` is case-sensitive (:func:`is_ray_remote`).
Stdlib only; nothing here imports anything of the shim's.
"""

from __future__ import annotations

S3 = ("s3", "s3a")
GCS = ("gs", "gcs")
#: Ray's Azure schemes (2.50+) and vLLM's (0.18+).
AZURE = ("abfss", "abfs", "azure", "az")
#: What vLLM 0.23's ``is_cloud_storage`` calls an object store.
VLLM_OBJECT_STORE = ("s3", "gs", "az")
#: What Ray 2.45-2.51 download themselves (``is_remote_path``: exact prefixes, case-sensitive).
RAY_REMOTE_PREFIXES = ("s3://", "gs://")
#: The streamer's backend package and pip extra per scheme.
STREAMER_BACKENDS = {"s3": ("runai_model_streamer_s3", "s3"), "gs": ("runai_model_streamer_gcs", "gcs")}


def scheme_of(uri: object) -> str:
    """``"s3"`` for ``S3://bucket/x``; ``""`` for a path, a hub id or a non-string."""
    if not isinstance(uri, str):
        return ""
    scheme, sep, _ = uri.partition("://")
    return scheme.lower() if sep else ""


def is_s3(uri: object) -> bool:
    return scheme_of(uri) in S3


def is_gcs(uri: object) -> bool:
    return scheme_of(uri) in GCS


def is_azure(uri: object) -> bool:
    return scheme_of(uri) in AZURE


def is_vllm_object_store(uri: object) -> bool:
    return scheme_of(uri) in VLLM_OBJECT_STORE


def is_ray_remote(uri: object) -> bool:
    """Ray's own ``is_remote_path`` (case-sensitive, as Ray is: ``S3://`` is not remote to Ray)."""
    return isinstance(uri, str) and uri.startswith(RAY_REMOTE_PREFIXES)
