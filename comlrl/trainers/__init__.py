"""Trainers by family (CoMLRL's ``comlrl.trainers`` names)."""

from .reinforce import (MAGRPOConfig, MAGRPOTrainer, MAREINFORCEConfig, MAREINFORCETrainer, MAReMaxConfig,
                        MAReMaxTrainer, MARLOOConfig, MARLOOTrainer)

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MAReMaxConfig",
           "MAReMaxTrainer", "MARLOOConfig", "MARLOOTrainer"]
