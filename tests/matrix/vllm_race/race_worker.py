"""One engine starting, up to and through vLLM's pull of the non-weight files.

N of these run at once (``test_vllm_race.py``), each building vLLM's engine config
from an object-store model for several rounds, all released together at every
round by a file barrier: what Ray Data ``concurrency>1`` or several Serve
replicas do on one node. Ray is imported first, as in a Ray actor (the shim's
tables key on Ray's version); the shim only when asked.

    python race_worker.py <sync dir> <index> <n> <rounds> <uri> <shim 0|1> <out.json>
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def barrier(sync: Path, name: str, index: int, n: int, timeout: float = 600.0) -> None:
    (sync / f"{name}.{index}").touch()
    deadline = time.monotonic() + timeout
    while len(list(sync.glob(f"{name}.*"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: the other workers never arrived")
        time.sleep(0.0005)


def main(argv: list[str]) -> int:
    sync, index, n, rounds, uri, shim, out = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4], \
        argv[5] == "1", Path(argv[6])
    import ray  # noqa: F401  (as in an actor)

    status: dict = {}
    if shim:
        import ray_runai_shim

        ray_runai_shim.install()
    from vllm.engine.arg_utils import EngineArgs

    if shim:
        status = ray_runai_shim.status()
    results = []
    for r in range(rounds):
        args = EngineArgs(model=uri, load_format="runai_streamer", dtype="float32", max_model_len=256,
                          enforce_eager=True)
        barrier(sync, f"round{r}", index, n)
        try:
            config = args.create_engine_config()
            mc = config.model_config
            results.append({"ok": True, "model": mc.model, "tokenizer": mc.tokenizer,
                            "model_weights": getattr(mc, "model_weights", None),
                            "served_model_name": mc.served_model_name})
        except Exception as e:  # the race: what each engine would have died of
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:400]})
    barrier(sync, "done", index, n)
    # After every worker finished: what each successful config's directory holds now.
    for res in results:
        if res["ok"]:
            top = Path(res["model"])
            res["files_after"] = sorted(p.relative_to(top).as_posix() for p in top.rglob("*") if p.is_file())
    out.write_text(json.dumps({"results": results, "patched": status.get("patched", [])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
