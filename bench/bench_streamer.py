"""bench part: vLLM's own Run:ai weight iterator over the checkpoint's shards, in a fresh process.

    python bench/bench_streamer.py s3://bucket/model/model-00001-of-00002.safetensors ...

Prints one JSON line: seconds to iterate every tensor, bytes, tensors, and peak RSS.
The streamer reads ``RUNAI_STREAMER_CONCURRENCY`` / ``RUNAI_STREAMER_MEMORY_LIMIT`` from
the environment, which ``bench_coldstart.py`` varies per run.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main(files: list[str]) -> int:
    from vllm.model_executor.model_loader.weight_utils import runai_safetensors_weights_iterator

    start = time.perf_counter()
    tensors = nbytes = 0
    for _name, tensor in runai_safetensors_weights_iterator(files, False):
        tensors += 1
        nbytes += tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "tensors": tensors, "peak_rss_mib": peak}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
