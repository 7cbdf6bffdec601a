"""The reproduction from ray issue #55574, with the shim: weights stream, nothing is copied.

    python examples/stream_from_s3.py s3://bucket/path/to/model/ [--prompts N] [--json OUT]

On a GPU machine drop ``--cpu``. ``--cpu`` runs vLLM's CPU backend (float32, eager)
scheduled through a custom resource, which is how the embedded default and the
tests run on machines without an accelerator.
"""

import ray_runai_shim  # noqa: F401, I001  (first line; nothing else changes)

import argparse
import json
import sys
import time

import ray
from ray.data.llm import build_llm_processor, vLLMEngineProcessorConfig

PROMPTS = [
    "The quick brown fox",
    "Hello world, this is",
    "Ray Data runs batch inference",
    "What is the capital of France?",
]


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_source")
    ap.add_argument("--load-format", default="runai_streamer")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cpu", action="store_true", help="run vLLM's CPU backend (no GPU)")
    ap.add_argument("--address", help="connect to this Ray cluster instead of starting one")
    ap.add_argument("--json", help="write the rows here as JSON")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1, help="engines (Ray Data actors)")
    args = ap.parse_args(argv)

    engine_kwargs = {"load_format": args.load_format, "max_model_len": 128}
    if args.tensor_parallel_size > 1:
        engine_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    slots = args.tensor_parallel_size * args.concurrency
    extra = {}
    if args.address:
        ray.init(address=args.address)
    elif args.cpu:
        ray.init(num_cpus=slots + 2, resources={"fake_accel": slots}, include_dashboard=False)
    if args.cpu:
        engine_kwargs.update(dtype="float32", enforce_eager=True, max_num_seqs=4)
        # Schedule the engine on a custom resource instead of a GPU (the knob moved in Ray 2.50).
        if "placement_group_config" in vLLMEngineProcessorConfig.model_fields:
            extra["placement_group_config"] = {"bundles": [{"CPU": 1, "GPU": 0, "fake_accel": 1}]}
        else:
            extra["resources_per_bundle"] = {"fake_accel": 1}

    config = vLLMEngineProcessorConfig(
        model_source=args.model_source,
        engine_kwargs=engine_kwargs,
        concurrency=args.concurrency,
        batch_size=4,
        apply_chat_template=False,
        tokenize=False,
        detokenize=False,
        **extra,
    )
    processor = build_llm_processor(
        config,
        preprocess=lambda row: dict(
            prompt=row["item"],
            sampling_params=dict(temperature=0.0, max_tokens=args.max_tokens),
        ),
        postprocess=lambda row: dict(
            prompt=row["prompt"],
            generated_text=row["generated_text"],
            generated_tokens=[int(t) for t in row["generated_tokens"]],
        ),
    )
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    start = time.perf_counter()
    rows = processor(ray.data.from_items(prompts)).take_all()
    elapsed = time.perf_counter() - start
    rows.sort(key=lambda r: r["prompt"])
    for r in rows:
        print(f"{r['prompt']!r} -> {r['generated_text']!r}")
    print(f"{len(rows)} rows in {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": elapsed}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
