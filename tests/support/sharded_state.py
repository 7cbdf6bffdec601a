"""A ``runai_streamer_sharded`` checkpoint of the tiny model, written by real vLLM.

vLLM's sharded-state format (``model-rank-<r>-part-<p>.safetensors``, vLLM's own
parameter names) can only be produced by a running engine, so this starts the
vLLM CPU engine once on the tiny model, saves its sharded state, and records the
engine's greedy tokens for the example's prompts as the reference the pipeline
must reproduce. Cached next to the tiny model builds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .tiny_model import copy_nonweight_files

_SCRIPT = r"""
import json, os, sys
def main():
    src, out, tokens_file, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    llm = LLM(model=src, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    tokens = {o.prompt: list(o.outputs[0].token_ids) for o in outs}
    os.makedirs(out, exist_ok=True)
    llm.llm_engine.engine_core.save_sharded_state(path=out, max_size=400_000)
    add_linear_weights(src, out)
    with open(tokens_file, "w") as f:
        json.dump(tokens, f)


def add_linear_weights(src, out):
    # vLLM's CPU backend repacks linear layers after loading, so the state it saves lacks
    # them; add them from the HF checkpoint under vLLM's fused names (qkv_proj, gate_up_proj).
    import glob
    import torch
    from safetensors.torch import load_file, save_file
    hf = {}
    for f in glob.glob(os.path.join(src, "*.safetensors")):
        hf.update(load_file(f))
    saved = set()
    parts = sorted(glob.glob(os.path.join(out, "model-rank-0-part-*.safetensors")))
    for f in parts:
        saved.update(load_file(f))
    extra = {}
    for name, t in hf.items():
        if ".self_attn.q_proj." in name:
            fused = name.replace("q_proj", "qkv_proj")
            parts_ = [hf[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            extra[fused] = torch.cat(parts_, 0)
        elif ".mlp.gate_proj." in name:
            extra[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, hf[name.replace("gate", "up")]], 0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            extra[name] = t
    extra = {k: v.contiguous() for k, v in extra.items() if k not in saved}
    save_file(extra, os.path.join(out, f"model-rank-0-part-{len(parts)}.safetensors"))


if __name__ == "__main__":
    main()
"""


def build_sharded_state(src: Path, out: Path, prompts: list[str], env: dict[str, str], python: str) -> dict:
    """Build (or reuse) the sharded checkpoint of ``src`` in ``out``; return the reference tokens."""
    tokens_file = out.with_suffix(".tokens.json")
    if out.is_dir() and tokens_file.is_file():
        return json.loads(tokens_file.read_text())
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staged_tokens = staging.with_suffix(".tokens.json")
    proc = subprocess.run(
        [python, "-c", _SCRIPT, str(src), str(staging), str(staged_tokens), json.dumps(prompts)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"saving the sharded state failed:\n{proc.stderr[-4000:]}")
    copy_nonweight_files(src, staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    staged_tokens.rename(tokens_file)  # last: its presence marks a complete build
    return json.loads(tokens_file.read_text())
