"""Policy-gradient trainers for cooperating agents."""

from .config import MAGRPOConfig
from .magrpo import MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]
