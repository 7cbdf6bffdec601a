"""The weight/non-weight classifier and the key-to-path mapping (property tests)."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_runai_shim.errors import ShimError
from ray_runai_shim.snapshot.files import (
    WEIGHT_SUFFIXES,
    is_weight_file,
    plan_local_paths,
    safe_relative_path,
)

NONWEIGHTS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.txt",
    "merges.txt",
    "qwen.tiktoken",
    "configuration_foo.py",
    "modeling_foo.py",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "original/params.json",
    "original/tokenizer.model",
    "preprocessor_config.json",
    "README.md",
    "hash",
]
WEIGHTS = [
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "model-rank-0-part-0.safetensors",
    "model.tensors",
    "pytorch_model.bin",
    "original/consolidated.00.pth",
    "model.ckpt",
    "model-q4.gguf",
    "tf_model.h5",
    "flax_model.msgpack",
    "MODEL.SAFETENSORS",
    "onnx/model.onnx",
    "onnx/model.onnx_data",
]


@pytest.mark.parametrize("name", NONWEIGHTS)
def test_non_weight_files_are_fetched(name):
    assert not is_weight_file(name)


@pytest.mark.parametrize("name", WEIGHTS)
def test_weight_files_are_never_fetched(name):
    assert is_weight_file(name)


segment = st.text(
    alphabet=st.characters(blacklist_characters="/\\\x00", blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda s: s not in (".", ".."))


@given(st.lists(segment, min_size=1, max_size=4), st.sampled_from(sorted(WEIGHT_SUFFIXES)))
def test_any_key_ending_in_a_weight_suffix_is_a_weight(parts, suffix):
    key = "/".join(parts) + suffix
    assert is_weight_file(key)
    assert is_weight_file(key.upper())


@given(st.lists(segment, min_size=1, max_size=4), st.sampled_from([".json", ".jinja", ".txt", ".py", ".model"]))
def test_config_like_suffixes_are_never_weights(parts, suffix):
    assert not is_weight_file("/".join(parts) + suffix)


@given(st.lists(segment, min_size=1, max_size=5))
def test_safe_keys_map_inside_the_destination(parts):
    key = "/".join(parts)
    rel = safe_relative_path(key)
    assert not rel.is_absolute()
    assert ".." not in rel.parts
    assert str(PurePosixPath("/dest", rel)).startswith("/dest/")


@given(st.lists(st.one_of(segment, st.just(".."), st.just(".")), min_size=1, max_size=5))
def test_dot_segments_are_refused_not_rewritten(parts):
    key = "/".join(parts)
    if ".." in parts or "." in parts:
        with pytest.raises(ShimError, match="refusing object key"):
            safe_relative_path(key)
    else:
        safe_relative_path(key)


@pytest.mark.parametrize("key", ["/etc/passwd", "../../.bashrc", "a/../../b", "a\\..\\b", "", "a/\x00", "./x"])
def test_hostile_keys_are_refused(key):
    with pytest.raises(ShimError, match="refusing object key"):
        safe_relative_path(key)


def test_keys_that_collide_after_normalisation_are_refused():
    with pytest.raises(ShimError, match="both map to"):
        plan_local_paths(["a/b.json", "a//b.json"])
    with pytest.raises(ShimError, match="both a file and a folder"):
        plan_local_paths(["tok", "tok/vocab.txt"])


@given(st.lists(st.lists(segment, min_size=1, max_size=3).map("/".join), unique=True, max_size=12))
def test_plan_is_injective_or_refused(keys):
    try:
        plan = plan_local_paths(keys)
    except ShimError:
        return
    assert len(set(plan.values())) == len(keys)
