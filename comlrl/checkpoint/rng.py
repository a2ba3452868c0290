"""Global random states (Python, NumPy, torch CPU and CUDA): captured into a checkpoint as a JSON
part and a tensor part, restored on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state", "set_seed"]


def capture_rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python, NumPy, torch CPU and CUDA generator states: (JSON part, tensor part)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    json_part = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    return json_part, tensors


def restore_rng_state(json_part: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = json_part["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        # Same device count: exact. A different count (moved machine) restores what matches.
        cuda_keys = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
        states = [tensors[k] for k in cuda_keys]
        for i, s in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
