"""The version table: each Ray minor gets exactly the patches it needs."""

import pytest

from ray_runai_shim.tables.support import (
    ACTIVATION,
    AUX_PULL,
    DOWNLOAD,
    ENDPOINT,
    HANDOFF,
    OFFLINE,
    PEER_FILES,
    RELAY,
    RUNTIME_ENV,
    S3_ANONYMOUS,
    SHARDED_FORMAT,
    TOKENIZER,
    installed,
    is_streaming_format,
    normalize_load_format,
    parse_version,
    plan_for,
)


@pytest.mark.parametrize(
    "version, patches",
    [
        ("2.43.0", set()),
        ("2.44.1", set()),
        ("2.45.0", {RELAY, DOWNLOAD, HANDOFF, ENDPOINT, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        ("2.48.0", {RELAY, DOWNLOAD, HANDOFF, ENDPOINT, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        ("2.49.2", {RELAY, DOWNLOAD, HANDOFF, ENDPOINT, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        ("2.50.1", {RELAY, DOWNLOAD, HANDOFF, ACTIVATION, RUNTIME_ENV, TOKENIZER, PEER_FILES}),
        ("2.51.2", {RELAY, SHARDED_FORMAT, ACTIVATION, RUNTIME_ENV, TOKENIZER, S3_ANONYMOUS, AUX_PULL, PEER_FILES,
                    OFFLINE}),
        ("2.52.0", {RELAY, ACTIVATION, RUNTIME_ENV, TOKENIZER, S3_ANONYMOUS, AUX_PULL, PEER_FILES, OFFLINE}),
        ("2.55.1", {RELAY, ACTIVATION, RUNTIME_ENV, TOKENIZER, S3_ANONYMOUS, AUX_PULL, PEER_FILES, OFFLINE}),
        # Where vLLM is installed (this venv). Tokenizer-only downloads keep chat templates from 2.56
        # (ray#62121) but still drop vocab.json, merges.txt, special_tokens_map.json (#27 item 5).
        ("2.56.0", {RELAY, ACTIVATION, TOKENIZER, S3_ANONYMOUS, PEER_FILES, OFFLINE}),
        ("2.60.0", {RELAY, ACTIVATION, TOKENIZER, S3_ANONYMOUS, PEER_FILES, OFFLINE}),
    ],
)
def test_plan_per_ray_release(version, patches):
    plan = plan_for(version)
    assert plan.known and set(plan.patches) == patches


@pytest.mark.parametrize("version", ["2.56.0", "2.60.0"])
def test_without_vllm_ray_2_56_on_gets_nothing(version, monkeypatch):
    """A Ray-only environment (no vLLM: nothing there can stream) gets no patch, and is told why."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    installed.cache_clear()
    plan = plan_for(version)
    installed.cache_clear()
    assert plan.known and plan.patches == frozenset() and "vllm is not installed here" in plan.why


@pytest.mark.parametrize("version", ["2.61.0", "3.0.0", "2.42.1", "nightly", ""])
def test_unknown_ray_gets_no_patch(version):
    plan = plan_for(version)
    assert not plan.known and not plan.patches and "outside" in plan.why


def test_parse_version_handles_pre_releases():
    assert parse_version("2.48.0rc1") == (2, 48, 0)
    assert parse_version("2.50") == (2, 50, 0)
    assert parse_version("dev") is None


def test_load_format_normalisation_accepts_vllm_enums():
    import enum

    class LoadFormat(str, enum.Enum):
        RUNAI_STREAMER = "runai_streamer"

    assert normalize_load_format(LoadFormat.RUNAI_STREAMER) == "runai_streamer"
    assert is_streaming_format(" RunAI_Streamer ")
    assert not is_streaming_format("auto") and not is_streaming_format(None)
