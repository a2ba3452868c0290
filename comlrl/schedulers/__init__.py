"""Device placement (CoMLRL's ``comlrl.schedulers`` API)."""

from .._imports import require_torch

require_torch("comlrl.schedulers")  # before the first torch import: say how to install it

from ..engine.devices import PARALLEL_TRAINING_MODES, DeviceScheduler, normalize_parallel_training

__all__ = ["DeviceScheduler", "normalize_parallel_training", "PARALLEL_TRAINING_MODES"]
