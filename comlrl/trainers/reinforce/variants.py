"""The named MAGRPO variants: the same trainer with another default baseline (``advantage_mode``).

As in CoMLRL, the baseline a run uses is its config's ``advantage_mode``: these trainers differ
from :class:`MAGRPOTrainer` only by the config they build when ``args`` is None, and by name.
"""

from __future__ import annotations

from .config import MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from .magrpo import MAGRPOTrainer

__all__ = ["MAREINFORCETrainer", "MARLOOTrainer", "MAReMaxTrainer"]


class MAREINFORCETrainer(MAGRPOTrainer):
    """Multi-agent REINFORCE: no baseline, the advantage is the return (``advantage_mode="raw"``)."""

    config_class, algorithm_name = MAREINFORCEConfig, "MAREINFORCE"


class MARLOOTrainer(MAGRPOTrainer):
    """Leave-one-out baseline: the mean return of the group's other samples (``"rloo"``)."""

    config_class, algorithm_name = MARLOOConfig, "MARLOO"


class MAReMaxTrainer(MAGRPOTrainer):
    """The group's best return as baseline, ReMax-style; advantages are <= 0 (``"max"``)."""

    config_class, algorithm_name = MAReMaxConfig, "MAReMax"
