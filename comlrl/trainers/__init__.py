"""Trainers. MAGRPO lives in :mod:`comlrl.trainers.reinforce`."""

from .reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]
