"""comlrl: cooperative multi-agent reinforcement learning for language models.

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl.utils import read_checkpoint_metadata
"""

from .exceptions import (CheckpointDirError, CheckpointError, ComlrlError, ConfigError, DataError,
                         ResumeMismatchError, RewardError, TokenizerError, TransitionError)
from .trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "ComlrlError",
    "ConfigError",
    "DataError",
    "TokenizerError",
    "RewardError",
    "TransitionError",
    "CheckpointError",
    "CheckpointDirError",
    "ResumeMismatchError",
    "__version__",
]
