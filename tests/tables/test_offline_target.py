"""``vllm-offline-uri`` (#27 item 6): where it applies, and the wrapper on stand-in modules.

vLLM 0.10.2-0.22 under ``HF_HUB_OFFLINE=1`` hand an object-store model to ``get_model_path``
(a Hub ``snapshot_download``) while building ``EngineArgs``; 0.23 skips cloud URIs. Here: the
table's gate by Ray and by the installed vLLM's version (stand-in ``vllm`` modules, no vLLM
imported), and the wrapper's rule. The real releases run in the vLLM 0.15.1 layer
(``tests/matrix/vllm_offline/``, with its control); this venv's vLLM 0.32 is never patched.
"""

import logging
import sys
import types

import pytest
import wrapt

from ray_runai_shim import patches
from ray_runai_shim.integrations import offline
from ray_runai_shim.tables import targets
from ray_runai_shim.tables.support import (
    OFFLINE,
    VLLM_OFFLINE_HUB_LOOKUP,
    is_object_store_uri,
    patches_for,
    plan_for,
)

[TARGET] = [t for t in targets.TARGETS if t.patch == OFFLINE]


def test_the_target_is_vllms_own_name_limited_to_the_releases_with_the_lookup():
    assert (TARGET.module, TARGET.attr) == (targets.VLLM_ARG_UTILS, "get_model_path")
    assert TARGET.wrapper == "ray_runai_shim.integrations.offline:get_model_path"
    assert TARGET.only_for == ("vllm", *VLLM_OFFLINE_HUB_LOOKUP) == ("vllm", (0, 10), (0, 23))
    assert TARGET.if_has == "get_model_path"  # 0.10.0/0.10.1: no such call, skipped quietly


@pytest.mark.parametrize("version", ["2.51.2", "2.53.0", "2.54.1", "2.55.1", "2.58.1", "2.60.0"])
def test_every_ray_that_hands_vllm_the_uri_gets_the_patch(version):
    """Ray Data from 2.51 and Serve LLM from 2.52 give vLLM the object-store URI as the model."""
    assert OFFLINE in plan_for(version).patches and OFFLINE in patches_for(version)


@pytest.mark.parametrize("version", ["2.43.0", "2.44.1", "2.45.0", "2.48.0", "2.50.1", "2.61.0"])
def test_rays_that_hand_vllm_a_local_dir_or_are_unknown_do_not(version):
    """2.45-2.50: the shim's handoff gives vLLM a local directory (it exists: no lookup)."""
    assert OFFLINE not in patches_for(version)


def arg_utils_module(with_name: bool = True) -> types.ModuleType:
    module = types.ModuleType(targets.VLLM_ARG_UTILS)
    if with_name:
        def get_model_path(model, revision=None):  # vLLM's: a path that exists, else the Hub's cache
            raise ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': {model!r}")

        module.get_model_path = get_model_path
    return module


@pytest.fixture
def vllm_release(monkeypatch):
    """A stand-in ``vllm`` package of a given version (the gate reads ``vllm.__version__``)."""

    def install(version: str) -> None:
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))

    return install


@pytest.fixture
def wraps(monkeypatch):
    calls = []
    monkeypatch.setattr(patches.registry, "wrap", lambda *a: calls.append(a) or True)
    return calls


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.13.0", "0.15.1", "0.18.0", "0.22.1"])
def test_affected_vllm_gets_the_wrapper(version, vllm_release, wraps):
    vllm_release(version)
    module = arg_utils_module()
    patches._apply(TARGET, module)
    assert [(patch, name, attr) for patch, name, _m, attr, _w in wraps] == [
        (OFFLINE, f"{targets.VLLM_ARG_UTILS}.get_model_path", "get_model_path")]


@pytest.mark.parametrize("version", ["0.9.2", "0.23.0", "0.25.1", "0.32.0"])
def test_other_vllm_releases_are_left_alone(version, vllm_release, wraps, caplog):
    vllm_release(version)
    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"):
        patches._apply(TARGET, arg_utils_module())
    assert wraps == [] and "no bug to fix there" in caplog.text


@pytest.mark.parametrize("version", ["0.10.0", "0.10.1"])
def test_vllm_0_10_0_and_0_10_1_have_no_lookup_and_are_skipped_quietly(version, vllm_release, wraps, caplog):
    vllm_release(version)
    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"):
        patches._apply(TARGET, arg_utils_module(with_name=False))
    assert wraps == [] and "does not apply" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("uri", ["s3://models/llm/tiny", "S3://models/llm/tiny", "s3://anonymous@models/llm/tiny",
                                 "gs://models/llm/tiny", "az://container/llm/tiny"])
def test_an_object_store_uri_comes_back_unchanged(uri):
    get_model_path = wrapt.FunctionWrapper(arg_utils_module().get_model_path, offline.get_model_path)
    assert is_object_store_uri(uri)
    assert get_model_path(uri, None) is uri
    assert get_model_path(model=uri, revision="main") is uri


def test_anything_else_goes_to_vllms_own_lookup(tmp_path):
    seen = []

    def get_model_path(model, revision=None):
        seen.append((model, revision))
        return f"/hub/{model}"

    wrapped = wrapt.FunctionWrapper(get_model_path, offline.get_model_path)
    assert wrapped("org/name", "v1") == "/hub/org/name"
    assert wrapped(tmp_path, None) == f"/hub/{tmp_path}"  # a Path (vLLM's own check: it exists)
    assert wrapped("hf://org/name") == "/hub/hf://org/name"
    assert seen == [("org/name", "v1"), (tmp_path, None), ("hf://org/name", None)]


def test_vllms_own_error_for_a_repo_id_is_vllms(caplog):
    """fail-open: an error raised by vLLM's lookup reaches the user untouched, no shim WARNING."""
    wrapped = wrapt.FunctionWrapper(arg_utils_module().get_model_path, offline.get_model_path)
    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"), pytest.raises(ValueError, match="Repo id"):
        wrapped("not/a/repo/id")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
