"""The REINFORCE family: MAGRPO, its named-baseline variants, and centralised MAGRPO."""

from .centralized_magrpo import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer
from .config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo import MAGRPOTrainer
from .variants import MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MARLOOConfig",
           "MARLOOTrainer", "MAReMaxConfig", "MAReMaxTrainer", "CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer"]
