"""Test driver: one Ray Serve LLM OpenAI app on a fresh local Ray, one request per model.

    python serve_app.py '<json: [[model_id, model_source], ...]>' OUT.json [ADDRESS]

``model_source`` is a string URI or ``{"bucket_uri": ...}`` (Ray's CloudMirrorConfig
form); an optional third item ``{"replicas": N}`` deploys N replicas of that model, and
``{"replicas": N, "per_node": 1}`` at most one per node (each bundle takes the node's one
``rrs_replica_slot``). With ADDRESS the app runs on that running cluster (its nodes say which
resources they have; the HTTP proxy on the head node only, as every node is this machine). The shim is imported first, exactly as a user would (``RAY_RUNAI_SHIM_DISABLE=1``
makes that a no-op for control runs). vLLM runs on its CPU backend; the logical
``accelerator_type:Intel-GAUDI`` resource keeps Serve's engine config in the replica
(``use_gpu`` is False for non-NVIDIA types). Writes ``{model_id: response | error}``.
"""

import ray_runai_shim  # noqa: F401, I001

import json
import socket
import sys
import time
import urllib.error
import urllib.request

import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app

PROMPT = "The quick brown fox"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return {"status": r.status, "body": json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode(errors="replace")[:4000]}


def _start_serve(port: int, head_only: bool = False) -> None:
    """``serve.start``, then wait until the HTTP proxy answers its health route.

    On a loaded 2-core box Serve's first proxy can miss its three 5 s readiness checks; the
    controller then kills it and starts another, and ``serve.start``'s wait on the first one
    raises ``ActorDiedError``. The controller carries on, so connect to it again and wait for
    the replacement to answer (CI failed this way once with another test file beside it). Before
    any app is deployed the health route answers 503 "Route table is not populated yet": any
    HTTP answer means the proxy is up; ``serve.run`` then waits for the apps themselves.
    """
    http = {"host": "127.0.0.1", "port": port}
    where = "HeadOnly" if head_only else None
    try:
        serve.start(http_options=http, proxy_location=where)
    except ray.exceptions.ActorDiedError as e:
        if "ProxyActor" not in str(e):
            raise
        print("serve_app: Serve replaced its first HTTP proxy (readiness checks missed under load); "
              "waiting for the new one", file=sys.stderr, flush=True)
        serve.start(http_options=http, proxy_location=where)  # connects to the running controller
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/healthz", timeout=5):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's HTTP proxy on port {port} not answering after 180 s")
        time.sleep(1)


def main(apps: list, out: str, address: str = "") -> None:
    options = [app[2] if len(app) > 2 else {} for app in apps]
    replicas = [int(o.get("replicas", 1)) for o in options]
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=8, resources={"accelerator_type:Intel-GAUDI": sum(replicas)}, include_dashboard=False)
    configs = [
        LLMConfig(
            model_loading_config={"model_id": model_id, "model_source": source},
            engine_kwargs={
                "load_format": "runai_streamer", "max_model_len": 128, "dtype": "float32",
                "enforce_eager": True, "max_num_seqs": 4,
            },
            accelerator_type="Intel-GAUDI",
            resources_per_bundle={"CPU": 1, **({"rrs_replica_slot": 1} if o.get("per_node") else {})},
            deployment_config={"autoscaling_config": {"min_replicas": n, "max_replicas": n}},
            # One OpenAI router, not Ray's default of two per model replica: each router replica
            # is a process importing Serve LLM and vLLM's API (~10 CPU-s), and nothing here needs
            # more than one. The shim acts in the model replicas, never in the router.
            experimental_configs={"num_router_replicas": 1},
        )
        for (model_id, source, *_), n, o in zip(apps, replicas, options)
    ]
    port = _port()
    _start_serve(port, head_only=bool(address))
    result: dict = {"port": port}
    start = time.perf_counter()
    try:
        serve.run(build_openai_app({"llm_configs": configs}), blocking=False)
        result["deploy_seconds"] = time.perf_counter() - start
        for model_id, *_ in apps:
            result[model_id] = _post(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0},
            )
    except Exception as e:  # the control run stops its engine on purpose
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
    with open(out, "w") as f:
        json.dump(result, f)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2], *sys.argv[3:4])
