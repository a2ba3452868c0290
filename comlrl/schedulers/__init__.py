"""Device placement (CoMLRL's ``comlrl.schedulers`` API)."""

from ..engine.devices import PARALLEL_TRAINING_MODES, DeviceScheduler, normalize_parallel_training

__all__ = ["DeviceScheduler", "normalize_parallel_training", "PARALLEL_TRAINING_MODES"]
