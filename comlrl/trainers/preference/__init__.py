"""The preference family (CoMLRL's ``comlrl.trainers.preference``): MADPO, MARLHF and their
iterative variants, and the centralised adapters shared with centralised MAGRPO."""

from ...exceptions import ComparatorError
from .centralized import (CentralizedComparatorAdapter, CentralizedComparatorParseError,
                          TaggedCentralizedComparatorAdapter)
from .iterative import MADPOIterConfig, MADPOIterTrainer, MARLHFIterConfig, MARLHFIterTrainer
from .madpo import MADPOConfig, MADPOTrainer
from .marlhf import JointRewardModel, MARLHFConfig, MARLHFTrainer

__all__ = ["ComparatorError", "MADPOConfig", "MADPOTrainer", "CentralizedComparatorAdapter", "CentralizedComparatorParseError",
           "TaggedCentralizedComparatorAdapter", "MADPOIterConfig", "MADPOIterTrainer", "MARLHFConfig",
           "MARLHFTrainer", "MARLHFIterConfig", "MARLHFIterTrainer", "JointRewardModel"]
