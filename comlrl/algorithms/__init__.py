"""Algorithms written on the public extension surface alone (:mod:`comlrl.extend` and its
registries), as a user's own would be: each module here imports nothing of comlrl but
``comlrl.extend`` and ``comlrl.exceptions`` (tests/test_layering.py checks it)."""

from .._imports import lazy_exports

__all__ = ["DrGRPOConfig", "DrGRPOTrainer"]

__getattr__, __dir__ = lazy_exports(__name__, {"DrGRPOConfig": ".dr_grpo", "DrGRPOTrainer": ".dr_grpo"})
