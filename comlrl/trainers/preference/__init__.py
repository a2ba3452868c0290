"""The preference family (CoMLRL's ``comlrl.trainers.preference``): MADPO, MARLHF and their
iterative variants, and the centralised adapters shared with centralised MAGRPO. Each name loads
its module on first use (the iterative trainers need more than MADPO does)."""

from typing import TYPE_CHECKING

from ..._imports import lazy_exports
from ...exceptions import ComparatorError

if TYPE_CHECKING:
    from .centralized import (CentralizedComparatorAdapter, CentralizedComparatorParseError,
                              TaggedCentralizedComparatorAdapter)
    from .iterative import MADPOIterConfig, MADPOIterTrainer, MARLHFIterConfig, MARLHFIterTrainer
    from .madpo import MADPOConfig, MADPOTrainer
    from .marlhf import JointRewardModel, MARLHFConfig, MARLHFTrainer

_MODULES = {
    ".centralized": ["CentralizedComparatorAdapter", "CentralizedComparatorParseError",
                     "TaggedCentralizedComparatorAdapter"],
    ".iterative": ["MADPOIterConfig", "MADPOIterTrainer", "MARLHFIterConfig", "MARLHFIterTrainer"],
    ".madpo": ["MADPOConfig", "MADPOTrainer"],
    ".marlhf": ["JointRewardModel", "MARLHFConfig", "MARLHFTrainer"],
}

__all__ = ["ComparatorError", "MADPOConfig", "MADPOTrainer", "CentralizedComparatorAdapter", "CentralizedComparatorParseError",
           "TaggedCentralizedComparatorAdapter", "MADPOIterConfig", "MADPOIterTrainer", "MARLHFConfig",
           "MARLHFTrainer", "MARLHFIterConfig", "MARLHFIterTrainer", "JointRewardModel"]

__getattr__, __dir__ = lazy_exports(__name__, {name: module for module, names in _MODULES.items() for name in names})
