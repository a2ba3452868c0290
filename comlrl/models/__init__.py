"""Model wrappers: :mod:`comlrl.models.actor_critic` (a causal LM with a value head)."""

from .._imports import require_torch

require_torch("comlrl.models")  # before the first torch import: say how to install it
