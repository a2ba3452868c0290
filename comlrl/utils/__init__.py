"""Public helpers: reading checkpoints without loading models, finding the newest one, seeding."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..checkpoint import latest_checkpoint as _latest_checkpoint
from ..checkpoint import read_state

__all__ = ["read_checkpoint_metadata", "find_latest_checkpoint", "set_seed"]


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint says about its run, read from JSON alone (no model or tensor is loaded).

    Returns a dict with at least:

    * ``wandb``: None, or ``{"id", "project"[, "entity"]}``, ready to merge into ``wandb_config``;
    * ``checkpoint``: the checkpoint number N of ``checkpoint-N``;
    * ``epoch``: completed epochs; ``step_in_epoch``: micro-batches done in the next epoch;
    * ``env_step``: joint actions scored so far; ``global_step``: optimizer steps so far;
    * ``num_train_epochs``: the run length planned when it was saved; ``run_id``; ``config``.

    Raises:
        CheckpointError: the path is missing or is not a complete comlrl checkpoint.
    """
    state = read_state(path)
    keys = ("wandb", "checkpoint", "epoch", "step_in_epoch", "env_step", "global_step", "num_train_epochs",
            "run_id", "config", "comlrl_version")
    meta = {k: state.get(k) for k in keys}
    meta["path"] = str(Path(path))
    return meta


def find_latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The newest complete (verified) ``checkpoint-N`` in ``directory``, or None."""
    return _latest_checkpoint(directory)


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
