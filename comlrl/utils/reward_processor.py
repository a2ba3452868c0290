"""Reward processors: ``float -> float`` functions for a trainer's ``reward_processor``."""

from __future__ import annotations

from typing import Callable

__all__ = ["RewardProcessors"]


class RewardProcessors:
    """Factories of common reward processors (CoMLRL's names)."""

    @staticmethod
    def scale(factor: float = 1.0) -> Callable[[float], float]:
        """``r -> r * factor``."""
        def process(reward: float) -> float:
            return reward * factor
        return process

    @staticmethod
    def shift(value: float = 0.0) -> Callable[[float], float]:
        """``r -> r + value``."""
        def process(reward: float) -> float:
            return reward + value
        return process
