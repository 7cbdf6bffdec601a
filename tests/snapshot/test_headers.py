"""The largest tensor of a checkpoint, from its safetensors headers: local files and ranged
reads from a real S3 server (two small reads per object, never the tensors)."""

from __future__ import annotations

import json
import struct

import pytest
from support.fixtures import BUCKET
from support.proxy import CountingProxy

from ray_runai_shim.snapshot import headers
from ray_runai_shim.stores.endpoint import endpoint_s3_filesystem


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("headers")
    save_file({"a": torch.zeros(10, 10), "b": torch.zeros(1000)}, str(d / "s1.safetensors"))  # 4,000 bytes
    save_file({"c": torch.zeros(30, 100, dtype=torch.float16)}, str(d / "s2.safetensors"))  # 6,000 bytes
    return d


def test_the_largest_tensor_of_local_files(shards):
    assert headers.largest_local([shards / "s1.safetensors"]) == 4000
    assert headers.largest_local(sorted(shards.glob("*.safetensors"))) == 6000
    assert headers.largest_local([]) == 0


def test_the_largest_tensor_in_the_store_reads_only_the_headers(s3, models, shards, monkeypatch):
    client = s3.client()
    for p in shards.glob("*.safetensors"):
        client.upload_file(str(p), BUCKET, f"headers/{p.name}")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    with CountingProxy(s3.port) as proxy:
        fs = endpoint_s3_filesystem(False, proxy.endpoint)
        got = headers.largest_remote(fs, [f"{BUCKET}/headers/s1.safetensors", f"{BUCKET}/headers/s2.safetensors"])
        sent = proxy.body_bytes(".safetensors")
    assert got == 6000
    assert sent < 1000  # the headers, not the 10,000 bytes of tensors


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors header"):
        headers.largest_local([bad])
    meta = {"__metadata__": {"format": "pt"}, "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert headers.largest_in_header(json.dumps(meta).encode()) == 8
