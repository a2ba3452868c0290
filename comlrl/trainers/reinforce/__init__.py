"""The REINFORCE family: MAGRPO, its named-baseline variants, centralised MAGRPO, and MAHAGRPO
(sequential HAPPO-style updates)."""

from .buffers import GroupBufferData, SequentialStepParts
from .centralized_magrpo import CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer
from .config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo import MAGRPOTrainer
from .mahagrpo import MAHAGRPOConfig, MAHAGRPOTrainer
from .variants import MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MARLOOConfig",
           "MARLOOTrainer", "MAReMaxConfig", "MAReMaxTrainer", "CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer",
           "MAHAGRPOConfig", "MAHAGRPOTrainer", "GroupBufferData", "SequentialStepParts"]
