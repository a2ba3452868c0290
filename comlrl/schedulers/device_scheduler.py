"""CoMLRL's ``comlrl.schedulers.device_scheduler`` module: the engine's device placement
(:mod:`comlrl.engine.devices`) under its public name."""

from ..engine.devices import PARALLEL_TRAINING_MODES, DeviceScheduler, check_available, normalize_parallel_training

__all__ = ["DeviceScheduler", "normalize_parallel_training", "PARALLEL_TRAINING_MODES", "check_available"]
