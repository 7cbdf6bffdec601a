"""Check, in the actor, that the loader vLLM will use can be imported at all.

Without the streamer (or its s3/gcs backend) vLLM fails deep inside engine
start-up, after the GPUs are reserved, with an ImportError that does not say
which pip package the actors are missing. Checking first costs one import that
vLLM would do anyway.
"""

from __future__ import annotations

import importlib

from ..errors import ShimError
from ..tables import schemes


def check_loader_importable(uri: str, load_format: str) -> None:
    if load_format == "tensorizer":
        needed = [("tensorizer", "tensorizer", "vllm[tensorizer]")]
    else:
        module, extra = schemes.STREAMER_BACKENDS.get(schemes.scheme_of(uri), (None, None))
        pip = f"runai-model-streamer[{extra}]" if extra else "runai-model-streamer"
        needed = [("runai_model_streamer", "runai-model-streamer", pip)]
        if module:
            needed.append((module, f"runai-model-streamer-{extra}", pip))
    for module, dist, pip in needed:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ShimError(
                f"ray-runai-shim: load_format={load_format!r} for {uri} needs the {dist} package "
                f"in the Ray actors, and importing {module} failed ({e}). Install it in the "
                f'cluster image or add it to the job: runtime_env={{"pip": ["{pip}"]}}.'
            ) from e
