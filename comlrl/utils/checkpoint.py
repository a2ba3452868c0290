"""Reading checkpoints without loading models: their metadata, the newest valid one, seeding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional


from .._redact import redact
from ..checkpoint import files
from ..checkpoint.manager import as_checkpoint_error, latest_checkpoint
from ..checkpoint.rng import set_seed
from ..checkpoint.state import validate_state

__all__ = ["read_checkpoint_metadata", "find_latest_checkpoint", "set_seed"]


def read_checkpoint_metadata(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint says about its run, from its JSON alone (no model or tensor is loaded).

    Works for comlrl's checkpoints and for those CoMLRL 1.4.3 wrote (``training_state.pt``, read
    without unpickling). Returns CoMLRL's keys:

    * ``wandb``: None, or ``{"id", "project"[, "entity"]}`` (plain strings, checked), ready to
      merge into ``wandb_config`` with ``"resume": "allow"``;
    * ``version``, ``trainer_class``, ``sequence`` (the checkpoint number), ``run_id``;

    and comlrl's: ``checkpoint``, ``epoch``, ``items_in_epoch``, ``env_step``, ``global_step``,
    ``num_train_epochs``, ``config``, ``comlrl_version``, ``path``, and ``trackers``: the other
    trackers' saved identities, e.g. ``{"mlflow": {"run_id", "experiment_id"}}`` (``{}`` when
    none; docs/tracking.md); ``launch``: the config ``comlrl train`` ran it with (None for a run of
    the Python API; see :mod:`comlrl.cli.launch`).

    Raises:
        CheckpointError: the path is missing, incomplete, edited or malformed.
    """
    path = Path(checkpoint).expanduser()
    from ..checkpoint.legacy import is_legacy_checkpoint, read_legacy_checkpoint

    if is_legacy_checkpoint(path):
        legacy = read_legacy_checkpoint(path)
        return {"wandb": legacy.wandb, "version": legacy.version, "trainer_class": legacy.trainer_class,
                "sequence": legacy.sequence, "run_id": legacy.run_id, "checkpoint": legacy.sequence,
                "epoch": legacy.epoch, "items_in_epoch": 0, "env_step": legacy.env_step, "global_step": None,
                "num_train_epochs": None, "config": redact(legacy.config), "comlrl_version": "1.4.3",
                "path": str(legacy.path), "trackers": {}, "launch": None}
    with as_checkpoint_error(path):
        manifest = files.read_manifest(path)
        state = validate_state(files.read_state(path), path, manifest["checkpoint"])
    counters = state["counters"]
    return {"wandb": state["wandb"], "version": manifest["format_version"], "trainer_class": state["trainer"],
            "sequence": counters["checkpoint"], "run_id": state["run_id"], "checkpoint": counters["checkpoint"],
            "epoch": counters["epoch"], "items_in_epoch": counters["items_in_epoch"],
            "env_step": counters["env_step"], "global_step": counters["global_step"],
            "num_train_epochs": state["num_train_epochs"], "config": state["config"],
            "comlrl_version": state["comlrl_version"], "path": str(path), "trackers": state["trackers"],
            "launch": state["launch"]}


def find_latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The newest ``checkpoint-N`` in ``directory`` that verifies (every file's hash, every state
    field), or None; a damaged newest checkpoint falls back to the one before it."""
    return latest_checkpoint(directory)
