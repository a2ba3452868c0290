"""The engine every trainer family shares (internal): inputs, prompts, episodes, the update step,
the epoch loop, metrics. A family is its algorithm on :class:`comlrl.engine.trainer.Trainer`."""

from .._imports import require_torch

require_torch("comlrl's training engine")  # before the first torch import: say how to install it
