"""CoMLRL's process-context helpers (comlrl's own data parallelism is :mod:`comlrl.engine.distributed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["DistributedContext", "local_context", "unwrap_model"]


@dataclass(frozen=True)
class DistributedContext:
    """Whether this process is the main one, and its device."""

    is_main: bool
    device: torch.device


def local_context(device: Optional[Union[str, torch.device]] = None) -> DistributedContext:
    """A single-process context on ``device`` (default: CUDA if available, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return DistributedContext(is_main=True, device=torch.device(device))


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a ``DistributedDataParallel``-style wrapper (``.module``), else itself."""
    return getattr(model, "module", model)
