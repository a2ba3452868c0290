"""Policy-gradient trainers for cooperating agents: MAGRPO and its named baseline variants."""

from .config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MARLOOConfig",
           "MARLOOTrainer", "MAReMaxConfig", "MAReMaxTrainer"]
