"""comlrl: cooperative multi-agent reinforcement learning for language models.

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl.utils import read_checkpoint_metadata

The trainers load on first use (``comlrl.MAGRPOTrainer``), so ``import comlrl`` and
``comlrl --help`` start without torch.
"""

from typing import TYPE_CHECKING

from ._imports import lazy_exports
from ._version import __version__
from .exceptions import (CheckpointDirError, CheckpointError, ComlrlError, ComparatorError,  # noqa: E402
                         ConfigError, DataError, ResumeMismatchError, RewardError, TokenizerError, TrackerError,
                         TrainingError, TransitionError)

if TYPE_CHECKING:
    from .trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = [
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "ComlrlError",
    "ConfigError",
    "DataError",
    "TokenizerError",
    "RewardError",
    "TransitionError",
    "TrainingError",
    "ComparatorError",
    "TrackerError",
    "CheckpointError",
    "CheckpointDirError",
    "ResumeMismatchError",
    "__version__",
]

__getattr__, __dir__ = lazy_exports(__name__, {"MAGRPOConfig": ".trainers.reinforce",
                                               "MAGRPOTrainer": ".trainers.reinforce"})
