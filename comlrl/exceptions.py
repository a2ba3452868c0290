"""The exceptions comlrl raises on bad input.

Every error a user can cause derives from :class:`ComlrlError`, and each also derives from the
built-in exception a Python user would try first (``ValueError``, ``TypeError``), so both
``except ComlrlError`` and ``except ValueError`` work.

    ComlrlError
    ├── ConfigError            (ValueError)  a config field is invalid; raised when the config is built
    │   └── ModelLoadError       (OSError)   a model or tokenizer given by name cannot be loaded: not a
    │                                        local directory, and not in the hub cache (hub offline)
    ├── DataError              (ValueError)  the dataset or a formatter output is unusable
    ├── TokenizerError         (ValueError)  tokenizer missing, incompatible with a model, ...
    ├── RewardError            (ValueError)  the reward function raised or returned bad values
    ├── TransitionError        (ValueError)  the external transition raised or returned bad prompts
    ├── TrainingError          (RuntimeError) training cannot go on: a non-finite loss or gradient,
    │   │                                     a trainer used after close(), ...
    │   ├── ComparatorError                  a preference comparator (e.g. an HTTP API) gave no answer
    │   └── TrackerError                     a tracker (report_to) failed; raised once the checkpoint
    │                                        due at that point is written (tracker_failure='raise')
    ├── SandboxError           (RuntimeError) comlrl.sandbox cannot run code as asked: a required
    │                                         isolation layer is unavailable, or a worker cannot start
    └── CheckpointError        (ValueError)  a checkpoint is missing, incomplete, corrupted or tampered
        ├── CheckpointDirError               checkpoint_dir holds another run's checkpoints
        └── ResumeMismatchError              resuming with settings that must not change
"""

from __future__ import annotations

__all__ = [
    "ComlrlError",
    "ConfigError",
    "ModelLoadError",
    "DataError",
    "TokenizerError",
    "RewardError",
    "TransitionError",
    "TrainingError",
    "ComparatorError",
    "SandboxError",
    "TrackerError",
    "CheckpointError",
    "CheckpointDirError",
    "ResumeMismatchError",
]


class ComlrlError(Exception):
    """Base class of every error comlrl raises because of user input."""


class ConfigError(ComlrlError, ValueError):
    """A configuration value is invalid. Raised when the config (or trainer) is built."""


class ModelLoadError(ConfigError, OSError):
    """A model or tokenizer named by a string (a hub name or a directory) cannot be loaded. Also an
    ``OSError``, the exception ``from_pretrained`` raises, so code that caught that still does."""


class DataError(ComlrlError, ValueError):
    """The training/eval dataset, or what a formatter made of it, cannot be used."""


class TokenizerError(ComlrlError, ValueError):
    """A tokenizer is missing, unusable, or incompatible with the agent models."""


class RewardError(ComlrlError, ValueError):
    """The reward function raised, or returned the wrong number or kind of values."""


class TransitionError(ComlrlError, ValueError):
    """The external transition raised, or did not return one non-empty prompt string per agent."""


class TrainingError(ComlrlError, RuntimeError):
    """Training stopped: a loss or gradient is not finite (nothing was applied or saved), or the
    trainer cannot be used any more."""


class ComparatorError(TrainingError):
    """The comparator of an iterative preference trainer could not produce candidates (after its
    retries): training stops before any update of the iteration, with the last checkpoint intact."""


class TrackerError(TrainingError):
    """A tracker of ``report_to`` (MLflow, W&B, TensorBoard, metrics.jsonl) failed while logging or
    syncing. With ``tracker_failure="raise"`` (the default) training stops once the checkpoint due
    at that point is written, so the failure never costs a checkpoint; resuming continues the
    tracker's run."""


class CheckpointError(ComlrlError, ValueError):
    """A checkpoint cannot be used: missing, incomplete, corrupted or tampered with."""


class CheckpointDirError(CheckpointError):
    """A run was pointed at a checkpoint directory that another run holds or has written to."""


class ResumeMismatchError(CheckpointError):
    """Resuming with models, data, reward function or settings that differ from the checkpoint's."""

    def __init__(self, checkpoint: str, differences: list[str]):
        self.checkpoint = checkpoint
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"Cannot resume from {checkpoint}: the run was set up differently when it was saved.\n"
            f"{lines}\n"
            "Only num_train_epochs, devices, logging / evaluation settings and checkpoint settings may "
            "change on resume. Restore the items above, or start a fresh run in a new checkpoint_dir."
        )


class SandboxError(ComlrlError, RuntimeError):
    """:mod:`comlrl.sandbox` cannot run code as asked: an isolation layer named in ``require`` is not
    available on this machine, a worker process cannot start, or the sandbox was closed."""
