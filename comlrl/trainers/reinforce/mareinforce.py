"""MAREINFORCE (CoMLRL module path): see :mod:`comlrl.trainers.reinforce.variants`."""

from .config import MAREINFORCEConfig
from .variants import MAREINFORCETrainer

__all__ = ["MAREINFORCEConfig", "MAREINFORCETrainer"]
