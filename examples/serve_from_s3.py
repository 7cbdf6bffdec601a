"""Ray Serve LLM streaming the weights from S3 with the shim: deploy, ask once, shut down.

    python examples/serve_from_s3.py s3://bucket/path/to/model/ [--mirror] [--json OUT]

``--mirror`` gives the source as ``{"bucket_uri": ...}`` (Ray's CloudMirrorConfig form)
instead of the string URI. ``--cpu`` runs vLLM's CPU backend (float32, eager) with a
CPU placement bundle, which is how the tests run on machines without an accelerator.
"""

import ray_runai_shim  # noqa: F401, I001  (first line; nothing else changes)

import argparse
import json
import socket
import sys
import time
import urllib.request

import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_source")
    ap.add_argument("--model-id", default="tiny")
    ap.add_argument("--mirror", action="store_true", help="pass the source as a CloudMirrorConfig")
    ap.add_argument("--load-format", default="runai_streamer")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cpu", action="store_true", help="run vLLM's CPU backend (no GPU)")
    ap.add_argument("--json", help="write the responses here as JSON")
    args = ap.parse_args(argv)

    source = {"bucket_uri": args.model_source} if args.mirror else args.model_source
    engine_kwargs = {"load_format": args.load_format, "max_model_len": 128}
    extra = {}
    if args.cpu:
        # Logical resources only: "accelerator_type:<X>" keeps Serve's engine config
        # in the replica (use_gpu is False for non-NVIDIA accelerator types).
        ray.init(num_cpus=4, resources={"accelerator_type:Intel-GAUDI": 1}, include_dashboard=False)
        engine_kwargs.update(dtype="float32", enforce_eager=True, max_num_seqs=4)
        extra.update(accelerator_type="Intel-GAUDI", resources_per_bundle={"CPU": 1})
    config = LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": source},
        engine_kwargs=engine_kwargs,
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        **extra,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    start = time.perf_counter()
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    ready = time.perf_counter() - start
    base = f"http://127.0.0.1:{port}/v1"
    completion = post(f"{base}/completions", {
        "model": args.model_id, "prompt": "The quick brown fox", "max_tokens": args.max_tokens,
        "temperature": 0.0,
    })
    print(json.dumps(completion, indent=1))
    print(f"deployed in {ready:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"completion": completion, "deploy_seconds": ready}, f)
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
