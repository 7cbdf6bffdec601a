"""Let vLLM's CPU platform run its Ray executor (test-only).

vLLM (0.32 here) ships ``CpuPlatform.ray_device_key = ""``, so
``distributed_executor_backend="ray"`` fails on CPU with "current platform cpu
does not support ray" before any worker exists. With
``RAY_RUNAI_SHIM_TEST_CPU_RAY=1`` the key is a custom Ray resource, ``vcpu``
(every node of the test cluster is started with one), and the worker's
"which node, which devices" answer is the node id plus device 0. That is all:
vLLM's Ray workers, their placement, gloo across nodes and the model load are
vLLM's own code. The shim must not need this.
"""

from __future__ import annotations

from typing import Any

from rrs_flags import ENV_CPU_RAY, flag

RESOURCE = "vcpu"


def enabled() -> bool:
    return flag(ENV_CPU_RAY)


def _node_and_device(self: Any) -> tuple[str, list[int]]:
    import ray

    return ray.get_runtime_context().get_node_id(), [0]


def install(wrapt: Any) -> None:
    @wrapt.when_imported("vllm.platforms.cpu")
    def _cpu(mod: Any) -> None:
        mod.CpuPlatform.ray_device_key = RESOURCE

    @wrapt.when_imported("vllm.v1.executor.ray_executor_v2")
    def _v2(mod: Any) -> None:
        mod.RayWorkerProc.get_node_and_physical_gpu_ids = _node_and_device

    @wrapt.when_imported("vllm.v1.executor.ray_utils")
    def _legacy(mod: Any) -> None:
        mod.RayWorkerWrapper.get_node_and_physical_gpu_ids = _node_and_device
