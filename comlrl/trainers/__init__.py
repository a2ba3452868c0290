"""Trainers by family (CoMLRL's ``comlrl.trainers`` names). Each family loads when one of its
names is first used: ``from comlrl.trainers.reinforce import ...`` loads neither of the others."""

from typing import TYPE_CHECKING

from .._imports import lazy_exports, require_torch

require_torch("comlrl.trainers")

if TYPE_CHECKING:
    from .actor_critic import ActorCriticTrainerBase, IACConfig, IACTrainer, MAACConfig, MAACTrainer
    from .preference import JointRewardModel, MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
    from .reinforce import (MAGRPOConfig, MAGRPOTrainer, MAHAGRPOConfig, MAHAGRPOTrainer, MAREINFORCEConfig,
                            MAREINFORCETrainer, MAReMaxConfig, MAReMaxTrainer, MARLOOConfig, MARLOOTrainer)

_FAMILIES = {
    ".reinforce": ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MAReMaxConfig",
                   "MAReMaxTrainer", "MARLOOConfig", "MARLOOTrainer", "MAHAGRPOConfig", "MAHAGRPOTrainer"],
    ".actor_critic": ["ActorCriticTrainerBase", "IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer"],
    ".preference": ["MADPOConfig", "MADPOTrainer", "MARLHFConfig", "MARLHFTrainer", "JointRewardModel"],
}

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MAReMaxConfig",
           "MAReMaxTrainer", "MARLOOConfig", "MARLOOTrainer", "ActorCriticTrainerBase", "IACConfig", "IACTrainer",
           "MAACConfig", "MAACTrainer", "MADPOConfig", "MADPOTrainer", "MARLHFConfig", "MARLHFTrainer",
           "JointRewardModel", "MAHAGRPOConfig", "MAHAGRPOTrainer"]

__getattr__, __dir__ = lazy_exports(__name__, {name: module for module, names in _FAMILIES.items()
                                               for name in names})
