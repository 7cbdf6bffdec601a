"""The ray#55574 reproduction as its reporter wrote it: chat messages, Ray Data's default stages.

    python examples/seed_pipeline.py s3://bucket/path/to/model/ [--cpu] [--json OUT]

Chat-template, tokenize, vLLM and detokenize stages, exactly as the issue's script
builds them. ``--cpu`` changes only what a machine without an accelerator needs:
the engine is scheduled on a custom resource, runs float32/eager, and the context
and answer length fit the tiny test model (256 positions).
"""

import ray_runai_shim  # noqa: F401, I001  (first line; nothing else changes)

import argparse
import json
import sys

import ray
from ray.data.llm import build_llm_processor, vLLMEngineProcessorConfig

QUESTIONS = ["What is the capital of France?", "Start of the haiku is: Complete this for me..."]


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_source")
    ap.add_argument("--cpu", action="store_true", help="run vLLM's CPU backend (no GPU)")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args(argv)

    engine_kwargs = {
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 4096,
        "max_model_len": 16384,
        "load_format": "runai_streamer",
        "tensor_parallel_size": 1,
    }
    temperature, max_tokens, extra = 0.3, 250, {}
    if args.cpu:
        # Logical CPUs: the chat-template, tokenize and detokenize actors take one each, and
        # the engine's bundle one more; four would deadlock the pipeline on a 2-core box.
        ray.init(num_cpus=6, resources={"fake_accel": 1}, include_dashboard=False)
        engine_kwargs.update(max_model_len=256, max_num_batched_tokens=256, dtype="float32",
                             enforce_eager=True, max_num_seqs=4)
        temperature, max_tokens = 0.0, 12  # greedy and short: comparable runs, a 256-position model
        if "placement_group_config" in vLLMEngineProcessorConfig.model_fields:  # Ray >= 2.50
            extra["placement_group_config"] = {"bundles": [{"CPU": 1, "GPU": 0, "fake_accel": 1}]}
        else:
            extra["resources_per_bundle"] = {"fake_accel": 1}

    config = vLLMEngineProcessorConfig(
        model_source=args.model_source,
        engine_kwargs=engine_kwargs,
        concurrency=1,
        batch_size=64,
        **extra,
    )
    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a bot that responds with haikus."},
                {"role": "user", "content": row["item"]},
            ],
            sampling_params=dict(temperature=temperature, max_tokens=max_tokens),
        ),
        postprocess=lambda row: dict(
            answer=row["generated_text"],
            **row,  # This will return all the original columns in the dataset.
        ),
    )
    ds = processor(ray.data.from_items(QUESTIONS))
    rows = sorted(ds.take_all(), key=lambda r: r["item"])
    for r in rows:
        print(f"{r['item']!r} -> {r['answer']!r}")
    if args.json:
        keep = ("item", "answer", "prompt", "generated_tokens")
        with open(args.json, "w") as f:
            json.dump({"rows": [{k: _plain(r.get(k)) for k in keep} for r in rows]}, f)
    return 0


def _plain(value):
    return [int(v) for v in value] if hasattr(value, "__len__") and not isinstance(value, str) else value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
