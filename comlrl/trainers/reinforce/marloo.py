"""MARLOO (CoMLRL module path): see :mod:`comlrl.trainers.reinforce.variants`."""

from .config import MARLOOConfig
from .variants import MARLOOTrainer

__all__ = ["MARLOOConfig", "MARLOOTrainer"]
