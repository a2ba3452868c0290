"""MAReMax (CoMLRL module path): see :mod:`comlrl.trainers.reinforce.variants`."""

from .config import MAReMaxConfig
from .variants import MAReMaxTrainer

__all__ = ["MAReMaxConfig", "MAReMaxTrainer"]
