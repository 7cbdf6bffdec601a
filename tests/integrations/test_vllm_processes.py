"""vLLM's own processes need no patch: the handoff travels in the pickled config.

With exactly what the shim hands vLLM (the local non-weight dir as ``model``, the
URI as ``model_weights``), a tensor-parallel-2 engine on CPU -- engine core plus
two worker processes that never import the shim -- streams the weights from the
bucket and generates.
"""

from __future__ import annotations

import pytest
from support.procs import last_json, run_python
from support.tiny_model import copy_nonweight_files

# extended: the same handoff through vLLM's own processes also runs in test_pipeline (one
# engine) and the matrix; this adds the TP=2 worker processes.
pytestmark = [pytest.mark.engine, pytest.mark.extended, pytest.mark.ray]


def test_tensor_parallel_2_workers_stream_from_the_uri_without_the_shim(s3, models, sandbox):
    model = models["tiny-sharded"]
    local = copy_nonweight_files(model.local, sandbox.root / "nonweights")
    code = f"""
if __name__ == "__main__":
    import json, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model={str(local)!r}, model_weights={model.uri!r}, load_format="runai_streamer",
              dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=4,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    out = llm.generate(["Hello world", "The quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
    print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in out],
                      "shim_loaded": "ray_runai_shim" in sys.modules}}))
"""
    env = {**sandbox.env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per TP rank
    env.pop("RAY_RUNAI_SHIM_TEST_ENGINE_LOG")
    proc = run_python(code, env=env, timeout=600)
    out = last_json(proc)
    assert out["shim_loaded"] is False
    # The tiny model is trained on these sentences, so it may end at </s> before 8 tokens.
    assert all(1 <= len(t) <= 8 for t in out["tokens"])
    logs = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"Worker_TP{rank}" in logs
    assert "Loading safetensors using Runai Model Streamer" in logs
    assert sandbox.weight_bytes_on_disk(model) == []
