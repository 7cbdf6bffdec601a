"""Azure sources are recognised and explained, never streamed (ray_runai_shim/stores/azure.py).

End to end: test_ray_data (Ray 2.48's real stage: Ray's own outcome plus one WARNING) and
test_doctor. Here: which requests count, and that nothing secret is repeated.
"""

from __future__ import annotations

import logging

import pytest

from ray_runai_shim.stores import azure

AZURE = ["abfss://c@acct.dfs.core.windows.net/m", "ABFS://c@acct.dfs.core.windows.net/m",
         "azure://c@acct.blob.core.windows.net/m", "az://c/m"]


@pytest.mark.parametrize("uri", AZURE)
def test_a_streaming_request_from_azure_gets_the_explanation(uri):
    note = azure.azure_note(uri, "RUNAI_STREAMER")
    assert note and "is an Azure source" in note and "load_format=runai_streamer" in note
    assert "az://<container>/<path>" in note and "vLLM >= 0.18" in note and "AZURE_STORAGE_ACCOUNT_NAME" in note


@pytest.mark.parametrize("uri, fmt", [(AZURE[0], "auto"), (AZURE[0], None), ("s3://b/m", "runai_streamer"),
                                      ("gs://b/m", "runai_streamer"), ("/local/dir", "runai_streamer"),
                                      (None, "runai_streamer")])
def test_anything_else_gets_nothing(uri, fmt):
    assert azure.azure_note(uri, fmt) is None


def test_no_sas_token_or_userinfo_is_repeated():
    note = azure.azure_note("azure://c@acct.blob.core.windows.net/m?sv=1&sig=SASTOKEN", "runai_streamer")
    assert "SASTOKEN" not in note and "c@acct" not in note and "acct.blob.core.windows.net/m" in note


def test_one_warning_per_process_and_source(caplog, monkeypatch):
    monkeypatch.setattr(azure, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="ray.runai_shim"):
        for _ in range(3):
            azure.warn_if_azure("az://c/m", {"load_format": "runai_streamer"})
        azure.warn_if_azure("az://c/other", {"load_format": "runai_streamer"})
        azure.warn_if_azure("az://c/m", {"load_format": "auto"})
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]
