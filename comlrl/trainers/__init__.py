"""Trainers by family (CoMLRL's ``comlrl.trainers`` names)."""

from .actor_critic import ActorCriticTrainerBase, IACConfig, IACTrainer, MAACConfig, MAACTrainer
from .preference import JointRewardModel, MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
from .reinforce import (MAGRPOConfig, MAGRPOTrainer, MAHAGRPOConfig, MAHAGRPOTrainer, MAREINFORCEConfig,
                        MAREINFORCETrainer, MAReMaxConfig, MAReMaxTrainer, MARLOOConfig, MARLOOTrainer)

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MAReMaxConfig",
           "MAReMaxTrainer", "MARLOOConfig", "MARLOOTrainer", "ActorCriticTrainerBase", "IACConfig", "IACTrainer",
           "MAACConfig", "MAACTrainer", "MADPOConfig", "MADPOTrainer", "MARLHFConfig", "MARLHFTrainer",
           "JointRewardModel", "MAHAGRPOConfig", "MAHAGRPOTrainer"]
