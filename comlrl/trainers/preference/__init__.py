"""The preference family (CoMLRL's ``comlrl.trainers.preference``). For now: the centralised
adapters shared with :class:`comlrl.trainers.reinforce.CentralizedMAGRPOTrainer`."""

from .centralized import (CentralizedComparatorAdapter, CentralizedComparatorParseError,
                          TaggedCentralizedComparatorAdapter)

__all__ = ["CentralizedComparatorAdapter", "CentralizedComparatorParseError", "TaggedCentralizedComparatorAdapter"]
