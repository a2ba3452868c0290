"""comlrl: cooperative multi-agent reinforcement learning for language models.

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl.utils import read_checkpoint_metadata
"""

from ._version import __version__
from .exceptions import (CheckpointDirError, CheckpointError, ComlrlError, ComparatorError,  # noqa: E402
                         ConfigError, DataError, ResumeMismatchError, RewardError, TokenizerError, TrackerError,
                         TrainingError, TransitionError)
from .trainers.reinforce import MAGRPOConfig, MAGRPOTrainer  # noqa: E402

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
