"""One engine's config and weights, built from an object-store URI with ``HF_HUB_OFFLINE=1``.

A fresh process per case: ``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, at import.
Ray is imported first, as in a Ray actor (the shim's tables key on Ray's version).

    python offline_worker.py <uri> <none|shim> <out.json> <local weight file>...

``none``: this vLLM alone. ``shim``: ``ray_runai_shim.install()``, every patch this Ray and vLLM
get. (The wrapper alone cannot be tried here: importing the shim activates all of them.)
Each stage is recorded; the first exception ends the run with its type, message and frames.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# This checkout's shim (not whichever one the base venv's editable install points at) and tests/ (support.*).
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def main(argv: list[str]) -> int:
    uri, mode, out, weight_files = argv[0], argv[1], Path(argv[2]), argv[3:]
    import huggingface_hub.constants
    import ray  # noqa: F401  (as in an actor)

    result: dict = {"mode": mode, "hf_hub_offline": bool(huggingface_hub.constants.HF_HUB_OFFLINE), "stages": []}
    if mode == "shim":
        import ray_runai_shim

        ray_runai_shim.install()
    import vllm.engine.arg_utils as au

    if mode == "shim":
        result["patched"] = ray_runai_shim.status()["patched"]
    try:
        args = au.EngineArgs(model=uri, load_format="runai_streamer", dtype="float32", max_model_len=256,
                             enforce_eager=True)
        result["stages"].append("args")
        result["args_model"] = args.model
        config = args.create_engine_config()
        result["stages"].append("config")
        mc = config.model_config
        result.update(model=mc.model, tokenizer=mc.tokenizer, model_weights=getattr(mc, "model_weights", None))
        import torch
        from safetensors.torch import load_file
        from support.vllm_loader import load_with_vllm_loader

        _loader, recorder = load_with_vllm_loader(config)
        result["stages"].append("streamed")
        expected: dict = {}
        for f in weight_files:
            expected.update(load_file(f))
        result["tensors"] = len(recorder.streamed)
        result["tensors_equal"] = sum(k in recorder.streamed and torch.equal(recorder.streamed[k], v)
                                      for k, v in expected.items())
        result["tensors_expected"] = len(expected)
    except Exception as e:  # what the engine would have died of
        result["error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"[:600]
        result["frames"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(e.__traceback__)]
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
