"""bench part: Llama-shaped synthetic checkpoints of any size, and moving them in and out of S3.

Shards of at most 1 GiB are written as valid safetensors by hand from one reused
block of float16 noise, so a GiB shard never has to exist in memory.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from bench_servers import BUCKET

GIB = 1 << 30
MIB = 1 << 20
SHARD_MAX_BYTES = GIB  # shards of ~1 GiB max, like HF's default max_shard_size range
TENSOR_COLS = 8192  # float16 -> 16 KiB per row
TENSOR_MAX_ROWS = 4096  # -> 64 MiB per tensor


def make_noise(nbytes: int) -> bytes:
    """Plausible float16 weights (N(0, 0.02)), generated once and reused for every tensor."""
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.02).astype(np.float16).tobytes()


def write_shard(path: Path, tensors: list[tuple[str, int]], noise: bytes) -> int:
    """Write a valid safetensors file by hand (header + raw F16 rows); return its size.

    Written by hand rather than with ``safetensors.numpy.save_file`` so a GiB
    shard never has to exist in memory: the same noise block is written repeatedly.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, rows in tensors:
        n = rows * TENSOR_COLS * 2
        header[name] = {"dtype": "F16", "shape": [rows, TENSOR_COLS], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _name, rows in tensors:
            left = rows * TENSOR_COLS * 2
            while left:
                piece = min(left, len(noise))
                f.write(noise[:piece])
                left -= piece
    return path.stat().st_size


def build_model(out: Path, weight_bytes: int, noise: bytes, shard_max_bytes: int = SHARD_MAX_BYTES) -> dict[str, Any]:
    """A Llama-shaped prefix: small config/tokenizer files plus ceil(size / shard_max_bytes) shards."""
    out.mkdir(parents=True, exist_ok=True)
    small = {
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": TENSOR_COLS,
            "num_hidden_layers": 1,
            "vocab_size": 32000,
            "torch_dtype": "float16",
        },
        "tokenizer.json": {
            "version": "1.0",
            "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(2000)}, "merges": []},
        },
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096},
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 16},
    }
    for name, obj in small.items():
        (out / name).write_text(json.dumps(obj, indent=1))
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    row_bytes = TENSOR_COLS * 2
    total_rows = max(1, weight_bytes // row_bytes)
    n_shards = max(1, math.ceil(total_rows * row_bytes / shard_max_bytes))
    rows_per_shard = math.ceil(total_rows / n_shards)
    weight_map: dict[str, str] = {}
    shards: list[Path] = []
    t = 0
    for i in range(n_shards):
        rows_left = min(rows_per_shard, total_rows - i * rows_per_shard)
        name = "model.safetensors" if n_shards == 1 else f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors: list[tuple[str, int]] = []
        while rows_left > 0:
            rows = min(TENSOR_MAX_ROWS, rows_left)
            tensors.append((f"model.layers.{t}.mlp.weight", rows))
            weight_map[f"model.layers.{t}.mlp.weight"] = name
            rows_left -= rows
            t += 1
        write_shard(out / name, tensors, noise)
        shards.append(out / name)
    if n_shards > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": total_rows * row_bytes}, "weight_map": weight_map}, indent=1
            )
        )
    from safetensors import safe_open  # cheap validity check: parses each header

    for shard in shards:
        with safe_open(str(shard), "np") as f:
            assert len(list(f.keys())) > 0, shard
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return {
        "files": files,
        "weight_bytes": sum(s for n, s in files.items() if n.endswith(".safetensors")),
        "nonweight_bytes": sum(s for n, s in files.items() if not n.endswith(".safetensors")),
        "shards": n_shards,
    }


def upload_dir(client: Any, local: Path, prefix: str, delete_after: bool = True) -> float:
    """Multipart-upload every file; delete each local copy once uploaded (saves disk)."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=64 * MIB, multipart_chunksize=64 * MIB, max_concurrency=4)
    start = time.perf_counter()
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}", Config=cfg)
        if delete_after:
            path.unlink()
    return time.perf_counter() - start


def delete_prefix(client: Any, prefix: str) -> None:
    """Free the server's disk copy of one size's model."""
    resp = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    keys = [{"Key": o["Key"]} for o in resp.get("Contents", [])]
    if keys:
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


#: Llama-shaped layer sizes for the cold-start checkpoint: head_dim 64 (vLLM's CPU attention
#: supports it), GQA 16/4. One float32 layer is ~60 MiB, so the layer count sets the size.
LLAMA_DIMS = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
              "num_key_value_heads": 4}


def llama_layers_for(weight_bytes: int, vocab_size: int) -> int:
    """How many float32 layers make the checkpoint about *weight_bytes* (at least 1)."""
    h, i = LLAMA_DIMS["hidden_size"], LLAMA_DIMS["intermediate_size"]
    kv = h * LLAMA_DIMS["num_key_value_heads"] // LLAMA_DIMS["num_attention_heads"]
    per_layer = (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) * 4
    fixed = (2 * vocab_size * h + h) * 4  # untied embeddings + lm_head + final norm
    return max(1, round((weight_bytes - fixed) / per_layer))


def build_llama(out: Path, weight_bytes: int, tokenizer_dir: Path, shard_bytes: int = 600 * MIB) -> dict[str, Any]:
    """A real, loadable Llama checkpoint of about *weight_bytes* (random float32 weights, seed 0).

    vLLM must actually run it (the cold-start benchmark times the real engine), so it
    uses transformers' own ``LlamaForCausalLM`` and ``save_pretrained`` (sharded), and
    the locally trained tokenizer of the tests' tiny model (``tokenizer_dir``).
    """
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        **LLAMA_DIMS,
        num_hidden_layers=llama_layers_for(weight_bytes, vocab),
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=shard_bytes, safe_serialization=True)
    del model
    for p in tokenizer_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (
            "config.json", "generation_config.json", "model.safetensors.index.json"
        ):
            shutil.copy2(p, out / p.name)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return {
        "files": files,
        "layers": config.num_hidden_layers,
        "weight_bytes": sum(s for n, s in files.items() if n.endswith(".safetensors")),
        "nonweight_bytes": sum(s for n, s in files.items() if not n.endswith(".safetensors")),
        "shards": sum(n.endswith(".safetensors") for n in files),
    }
