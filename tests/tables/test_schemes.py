"""One case rule for URI schemes: the shim's decisions read any case; the mirror of Ray's
own case-sensitive check keeps Ray's rule (and the tables use these, nothing else)."""

from __future__ import annotations

import pytest

from ray_runai_shim.stores.azure import is_azure_uri
from ray_runai_shim.tables import schemes
from ray_runai_shim.tables.support import is_object_store_uri, is_remote_uri


@pytest.mark.parametrize("uri, scheme", [("s3://b/m", "s3"), ("S3://b/m", "s3"), ("GS://b", "gs"),
                                         ("abfss://c@a.dfs.core.windows.net/m", "abfss"), ("/models/x", ""),
                                         ("org/model", ""), (None, "")])
def test_scheme_of_reads_any_case(uri, scheme):
    assert schemes.scheme_of(uri) == scheme


def test_the_shims_checks_read_any_case_and_rays_mirror_keeps_rays_rule():
    assert schemes.is_s3("S3A://b") and schemes.is_gcs("GCS://b") and is_azure_uri("AZ://c/m")
    assert is_object_store_uri("S3://b/m") and is_object_store_uri("az://c/m") and not is_object_store_uri("gcs://b")
    assert is_remote_uri("s3://b/m") and is_remote_uri("gs://b/m")
    assert not is_remote_uri("S3://b/m")  # Ray 2.45-2.51's is_remote_path: case-sensitive; Ray would not fetch it
