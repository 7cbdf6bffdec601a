"""vLLM's own runai loader on a built config: the weights it streams, kept for comparison.

Used by the layered-vLLM tests (``tests/matrix/vllm_envs.py``), where vLLM's engine
cannot start (the CUDA wheel's kernels do not load here): the loader's real
``load_model`` runs, and only the model class it fills is this recorder.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from typing import Any

import torch


class WeightRecorder(torch.nn.Module):
    """Stands for the model class: keeps what the loader streams into ``load_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.streamed: dict[str, torch.Tensor] = {}
        self.devices: set[str] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.devices.add(str(tensor.device))
            self.streamed[name] = tensor.detach().to("cpu").clone()
        return set(self.streamed)


def load_with_vllm_loader(config: Any) -> tuple[Any, WeightRecorder]:
    """vLLM's own loader for *config*, its own ``load_model``; only the model class is ours."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(config.load_config)
    recorder = WeightRecorder()
    module = sys.modules[type(loader).load_model.__module__]  # loader.py (0.8.5) / base_loader.py
    name = "initialize_model" if hasattr(module, "initialize_model") else "_initialize_model"
    original = getattr(module, name)
    setattr(module, name, lambda *a, **k: recorder)
    params = inspect.signature(loader.load_model).parameters
    kwargs = {"vllm_config": config}
    if "model_config" in params:  # 0.9.2+
        kwargs["model_config"] = config.model_config
    try:
        with set_current_vllm_config(config):
            loaded = loader.load_model(**kwargs)
    finally:
        setattr(module, name, original)
    assert loaded is recorder
    return loader, recorder
