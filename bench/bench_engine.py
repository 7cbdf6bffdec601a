"""bench part: one cold start, in a fresh driver process: build the processor, time the first row.

    <python> bench/bench_engine.py s3://bucket/model --method shim --result OUT.json [--engines N]

Run by ``bench_coldstart.py`` with the interpreter of the method's environment
(the base venv for Ray 2.48, the oracle layer for Ray 2.60). ``--method shim``
imports ``ray_runai_shim`` as its first line does in the README; the other methods
never import it. The pipeline is the README example's (``examples/stream_from_s3.py``,
CPU form), spelled in whichever API the installed Ray has. Stamps are
``time.time()`` so they line up with the stage actor's and EngineCore's timing
events (``tests/support/site/rrs_timing.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_source")
    ap.add_argument("--method", choices=["ray-alone", "shim", "native"], required=True)
    ap.add_argument("--engines", type=int, default=1, help="vLLM engines on this node (Ray Data concurrency)")
    ap.add_argument("--load-format", default="runai_streamer")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)

    t_start = time.time()
    if args.method == "shim":
        import ray_runai_shim  # noqa: F401  (what the README's first line does)
    import ray
    import ray.data.llm as llm

    shim_loaded = "ray_runai_shim" in sys.modules
    # Each engine's stage actor holds one logical CPU; the pre/post-processing tasks need one more.
    ray.init(num_cpus=max(2, args.engines + 1), resources={"fake_accel": args.engines}, include_dashboard=False)
    engine_kwargs = {
        "load_format": args.load_format,
        "max_model_len": 128,
        "dtype": "float32",
        "enforce_eager": True,
        "max_num_seqs": 4,
    }
    common = dict(model_source=args.model_source, engine_kwargs=engine_kwargs, concurrency=args.engines,
                  batch_size=4)
    if hasattr(llm, "build_processor"):  # Ray >= 2.5x: the renamed API (as tests/matrix/oracle_pipeline.py)
        config = llm.vLLMEngineProcessorConfig(
            **common,
            placement_group_config={"bundles": [{"fake_accel": 1}]},
            chat_template_stage=False, tokenize_stage=False, detokenize_stage=False, log_engine_metrics=False,
        )
        build = llm.build_processor
    else:
        fields = llm.vLLMEngineProcessorConfig.model_fields
        extra = ({"placement_group_config": {"bundles": [{"fake_accel": 1}]}}
                 if "placement_group_config" in fields else {"resources_per_bundle": {"fake_accel": 1}})
        config = llm.vLLMEngineProcessorConfig(**common, **extra, apply_chat_template=False, tokenize=False,
                                               detokenize=False)
        build = llm.build_llm_processor
    max_tokens = args.max_tokens
    t_build = time.time()
    processor = build(
        config,
        preprocess=lambda row: dict(prompt=row["item"],
                                    sampling_params=dict(temperature=0.0, max_tokens=max_tokens)),
        postprocess=lambda row: dict(prompt=row["prompt"], generated_text=row["generated_text"]),
    )
    prompts = [f"Prompt {i}: the quick brown fox" for i in range(4 * args.engines)]
    rows, t_first = [], None
    for row in processor(ray.data.from_items(prompts)).iter_rows():
        if t_first is None:
            t_first = time.time()
        rows.append(row)
    t_last = time.time()
    with open(args.result, "w") as f:
        json.dump({
            "method": args.method, "engines": args.engines, "ray": ray.__version__, "shim_loaded": shim_loaded,
            "t_start": t_start, "t_build": t_build, "t_first": t_first, "t_last": t_last, "rows": len(rows),
            "sample": rows[0]["generated_text"] if rows else None,
        }, f)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
