"""A real two-node Ray cluster on this machine (``ray start --head`` + ``ray start --address``).

The stage's actors run on the second node, whose processes never saw the driver's
``import``; the shim has to get there through the job's runtime_env, or through a
sitecustomize on the cluster image.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.cluster import RayCluster
from support.procs import REPO, base_env, last_json, run_python

pytestmark = pytest.mark.ray  # starts Ray (a cluster, a job, Serve, an engine) in its processes

RAY = str(Path(sys.executable).parent / "ray")
PROBE = """
import json, os, sys, ray

@ray.remote(resources={"node2": 1})
def probe():
    loaded = "ray_runai_shim.patches" in sys.modules
    import ray_runai_shim
    import ray.llm._internal.batch.stages.vllm_engine_stage  # what Ray Data's actor imports
    s = ray_runai_shim.status()
    return {"loaded_before_probe": loaded, "file": ray_runai_shim.__file__, "installed": s["installed"],
            "patched": s["patched"], "node": ray.get_runtime_context().get_node_id(),
            "concurrency": os.environ.get("RUNAI_STREAMER_CONCURRENCY"), "user_var": os.environ.get("USER_VAR")}
"""
STAGE_PATCH = "ray.llm._internal.batch.stages.vllm_engine_stage.download_model_files"


class Cluster(RayCluster):
    """Two nodes; only the second has the accelerator stand-in, so the vLLM stage runs there."""

    def __enter__(self) -> Cluster:
        self.start_head('--resources={"head_node": 1}', "--num-cpus=2")
        self.add_node('--resources={"node2": 1, "fake_accel": 1}', "--num-cpus=1")
        return self


@pytest.fixture
def cluster_env():
    # The cluster's processes get neither the driver's streamer settings nor the test site dir.
    return base_env({"RAY_USAGE_STATS_ENABLED": "0"}, site=False)


def test_driver_import_reaches_a_connected_clusters_second_node(cluster_env):
    with Cluster(cluster_env) as cluster:
        driver_env = {**cluster_env, "RUNAI_STREAMER_CONCURRENCY": "7", "HOME": str(cluster.root)}
        out = last_json(
            run_python(
                PROBE
                + f"""
import ray_runai_shim
ray.init(address={cluster.address!r}, runtime_env={{"env_vars": {{"USER_VAR": "mine"}}}})
r = ray.get(probe.remote())
r["node2"] = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("node2")]
r["head"] = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("head_node")]
print(json.dumps(r))
""",
                env=driver_env,
                cwd=cluster.root,
            )
        )
    assert [out["node"]] == out["node2"] != out["head"]  # ran on the second node
    assert out["loaded_before_probe"] and out["installed"] and STAGE_PATCH in out["patched"]
    # Not installed on the "cluster" from the driver's point of view -> shipped via py_modules.
    assert "/runtime_resources/py_modules_files/" in out["file"]
    assert out["user_var"] == "mine"  # the user's runtime_env survived the merge
    assert out["concurrency"] == "7"  # forwarded from the driver (set-if-absent)


def test_sitecustomize_on_the_cluster_image_activates_it_without_a_driver_import(cluster_env, tmp_path):
    site_dir = tmp_path / "image-site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text("import ray_runai_shim  # ray-runai-shim: cluster-wide\n")
    image_env = {**cluster_env, "PYTHONPATH": os.pathsep.join([str(site_dir), cluster_env.get("PYTHONPATH", "")])}
    with Cluster(image_env) as cluster:
        out = last_json(
            run_python(
                PROBE + f"ray.init(address={cluster.address!r})\nprint(json.dumps(ray.get(probe.remote())))",
                env={**cluster_env, "HOME": str(cluster.root)},
                cwd=cluster.root,
            )
        )
    assert out["loaded_before_probe"] and out["installed"] and STAGE_PATCH in out["patched"]
    assert "/runtime_resources/" not in out["file"]  # the image's copy, not a shipped one


def test_the_bootstrap_costs_nothing_until_ray_is_imported():
    out = last_json(
        run_python(
            "import time, sys, json\nt = time.perf_counter()\nimport ray_runai_shim\n"
            "dt = time.perf_counter() - t\n"
            "print(json.dumps({'ms': dt * 1e3, 'heavy': sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('ray', 'vllm', 'torch', 'wrapt', 'asyncio', 'pyarrow'))}))",
            env=base_env(site=False),
        )
    )
    assert out["heavy"] == []
    json.dumps(out)


# CI time (#37): in test-all; test_relay_cluster_engine.py runs the same example with a
# driver-imported shim and an engine on each node of a two-node cluster (no weight byte on disk).
@pytest.mark.engine
@pytest.mark.extended
def test_the_pipelines_stage_on_the_second_node_streams(s3, models, sandbox):
    """ray#55574's pipeline, driver-imported shim, the vLLM stage forced onto node 2."""
    model = models["tiny-sharded"]
    with Cluster({**sandbox.env, "HOME": str(sandbox.root / "home")}) as cluster:
        out = sandbox.root / "rows.json"
        proc = subprocess.run(
            [sys.executable, str(REPO / "examples" / "stream_from_s3.py"), model.uri, "--cpu",
             "--address", cluster.address, "--json", str(out)],
            env=sandbox.env, cwd=str(sandbox.root), capture_output=True, text=True, timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-6000:]
        logs = "\n".join(p.read_text(errors="replace") for p in cluster.root.glob("t/session_2*/logs/worker-*"))
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["generated_tokens"] for r in rows)
    calls = sandbox.engine_calls()
    [shim_dir] = sandbox.shim_dirs()
    # vLLM streams the URI, or (#37: one reader, but a cluster of two nodes) the node relay's copy of
    # it, read as it lands, that other nodes could take from this one
    assert calls and all(c["model"] == str(shim_dir) for c in calls)
    assert all(c["model_weights"] == model.uri or "/ray-runai-shim-relay-" in c["model_weights"] for c in calls)
    assert sandbox.weight_bytes_on_disk(model) == [] and not any(cluster.root.rglob("*.safetensors"))
    assert "/runtime_resources/py_modules_files/" in logs or re.search(r"ray-runai-shim: (fetched|reused)", logs)
