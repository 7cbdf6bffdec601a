"""Small safetensors checkpoints of random float32 tensors in the test bucket, and per-tensor
digests to compare what a reader loaded with what was written."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .fixtures import BUCKET


def digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes."""
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()).hexdigest()


def upload_model(s3: Any, tmp: Path, prefix: str, shards: dict[str, dict[str, tuple[int, ...]]], seed: int) -> dict:
    """Write *shards* (file name -> tensor name -> shape) under *tmp*, upload them and a config
    under *prefix*; the model's URI, weight files, per-tensor digests and size."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    want = {}
    client = s3.client()
    for name, spec in shards.items():
        tensors = {k: torch.randn(*shape, generator=g) for k, shape in spec.items()}
        save_file(tensors, str(tmp / name))
        want.update({k: digest(t) for k, t in tensors.items()})
        client.upload_file(str(tmp / name), BUCKET, f"{prefix}/{name}")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/config.json", Body=b"{}")
    return {"uri": f"s3://{BUCKET}/{prefix}", "weights": sorted(shards), "tensors": want, "local": tmp,
            "bytes": sum((tmp / n).stat().st_size for n in shards), "prefix": prefix}
