"""What ``trainer_state.json`` must hold: every field a resume trusts, checked for type and range.

The state's bytes are covered by the manifest's hash (:mod:`comlrl.checkpoint.files`); this module
checks that what was hashed is also well-formed, so that an edited or hand-made checkpoint raises
:class:`CheckpointError` naming the field instead of training on wrong counters (or deleting files
on the word of a wrong number).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

from ..exceptions import CheckpointError
from .files import SLOT_NAME
from ..tracking.trackers import check_tracker_identities
from ..tracking.wandb import check_identity

__all__ = ["COUNTERS", "RunRecord", "validate_state", "counters_of"]

COUNTERS = ("epoch", "items_in_epoch", "global_step", "env_step", "checkpoint", "last_logged_env_step")
INT64_MAX = 2**63 - 1  # every counter fits an int64 (TensorBoard, W&B and torch take its steps as one)
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _int(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "run_id": (lambda v: isinstance(v, str) and bool(_RUN_ID.match(v)), "32 lowercase hex digits"),
    "trainer": (lambda v: isinstance(v, str) and 0 < len(v) < 200, "a trainer class name"),
    "counters": (_is_dict, "an object of counters"),
    "log_window": (lambda v: _is_dict(v) and _is_dict(v.get("sums")) and _is_dict(v.get("counts")),
                   "an object with 'sums' and 'counts'"),
    "num_train_epochs": (_int(1), "an int >= 1"),
    "config": (_is_dict, "an object"),
    "fingerprints": (_is_dict, "an object"),
    "comlrl_version": (lambda v: isinstance(v, str), "a string"),
    "world_size": (_int(1), "an int >= 1"),
    "rng": (lambda v: _is_dict(v) and isinstance(v.get("python"), list) and isinstance(v.get("numpy"), list),
            "an object with 'python' and 'numpy' states"),
    "rng_other_ranks": (lambda v: isinstance(v, list) and all(_is_dict(r) for r in v), "a list of objects"),
    "optimizers": (_is_dict, "an object"),
    "schedulers": (_is_dict, "an object"),
    "algorithm": (_is_dict, "an object"),
}


@dataclass(frozen=True)
class RunRecord:
    """The run's part of ``trainer_state.json``, as the trainer hands it to a save (the checkpoint
    manager adds ``world_size``, ``rng``, ``rng_other_ranks``, ``schedulers`` and ``optimizers``;
    :func:`validate_state` checks the whole file on resume). One record, so that the fields a
    checkpoint holds are written down once."""

    run_id: str                          # 32 lowercase hex digits, the run's identity
    trainer: str                         # the trainer class's name
    counters: dict[str, int]             # COUNTERS
    log_window: dict[str, Any]           # {"sums": {...}, "counts": {...}} of the metrics not yet logged
    num_train_epochs: int
    config: dict[str, Any]               # the config's fields
    fingerprints: dict[str, Any]         # what a resumed run must share (config, models, data, reward, ...)
    comlrl_version: str
    algorithm: dict[str, Any]            # the family's own JSON state
    wandb: Optional[dict[str, Any]] = None               # the W&B run's identity
    trackers: dict[str, Any] = field(default_factory=dict)  # the other trackers' identities
    launch: Optional[dict[str, Any]] = None              # what `comlrl train` recorded
    folders: dict[str, str] = field(default_factory=dict)   # {slot: export folder}

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON object saved (a fresh, shallow dict: the manager adds to it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> "RunRecord":
        """The run's part of a validated state (:func:`validate_state`)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def validate_state(state: dict[str, Any], path: Path, number: int) -> dict[str, Any]:
    """Check every field of a checkpoint's state; returns it (with validated tracker identities:
    ``wandb``, and ``trackers``, ``{}`` when a checkpoint predates it; ``launch``, None when the
    run was not launched by ``comlrl train`` or the checkpoint predates it).

    Raises:
        CheckpointError: naming the checkpoint and the first field that is missing or malformed.
    """
    for name, (ok, what) in _FIELDS.items():
        if name not in state:
            raise CheckpointError(f"checkpoint {path}: {name!r} is missing from its state.")
        if not ok(state[name]):
            raise CheckpointError(f"checkpoint {path}: {name!r} must be {what}, got {state[name]!r:.80}.")
    counters = state["counters"]
    for name in COUNTERS:
        value = counters.get(name)
        if not _int(-1 if name == "last_logged_env_step" else 0)(value) or value > INT64_MAX:
            raise CheckpointError(f"checkpoint {path}: counter {name!r} must be a non-negative int below 2**63, "
                                  f"got {value!r:.40}.")
    if counters["checkpoint"] != number:
        raise CheckpointError(f"checkpoint {path}: its state says checkpoint {counters['checkpoint']}, its directory "
                              f"{number} (renamed or edited).")
    if counters["epoch"] > state["num_train_epochs"]:
        raise CheckpointError(f"checkpoint {path}: epoch {counters['epoch']} is beyond num_train_epochs "
                              f"{state['num_train_epochs']}.")
    if counters["last_logged_env_step"] > counters["env_step"]:
        raise CheckpointError(f"checkpoint {path}: last_logged_env_step is beyond env_step.")
    window = state["log_window"]
    if not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
               for k, v in window["sums"].items()) or \
            not all(isinstance(k, str) and _int(1)(v) for k, v in window["counts"].items()) or \
            set(window["sums"]) != set(window["counts"]):
        raise CheckpointError(f"checkpoint {path}: 'log_window' is malformed.")
    if len(state["rng_other_ranks"]) != state["world_size"] - 1:
        raise CheckpointError(f"checkpoint {path}: 'rng_other_ranks' does not match world_size.")
    state["wandb"] = check_identity(state.get("wandb"), f"checkpoint {path}")
    state["trackers"] = check_tracker_identities(state.get("trackers"), f"checkpoint {path}")
    state["launch"] = _check_launch(state.get("launch"), path)
    state["folders"] = _check_folders(state.get("folders"), path)
    return state


_FOLDER = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*$")  # relative, no '.', '..' or empty segment


def _check_folders(folders: Any, path: Path) -> dict[str, str]:
    """``{slot: export folder}`` (``{}`` when a checkpoint predates it): names a path inside the
    export directory, never outside it."""
    if folders is None:
        return {}
    if not _is_dict(folders) or not all(isinstance(k, str) and SLOT_NAME.match(k) and isinstance(v, str)
                                        and _FOLDER.match(v) and len(v) < 200 for k, v in folders.items()):
        raise CheckpointError(f"checkpoint {path}: 'folders' must map slot names to relative folder names, got "
                              f"{folders!r:.80}.")
    if len(set(folders.values())) != len(folders):
        raise CheckpointError(f"checkpoint {path}: 'folders' names one folder twice.")
    return dict(folders)


def _check_launch(launch: Any, path: Path) -> Any:
    """None (a run of the Python API), or what ``comlrl train`` recorded (comlrl.cli.launch)."""
    if launch is None:
        return None
    ok = (_is_dict(launch) and set(launch) in ({"config_file", "config"}, {"config_file", "config", "cwd"})
          and all(launch.get(k) is None or isinstance(launch[k], str) for k in ("config_file", "cwd"))
          and _is_dict(launch["config"]) and set(launch["config"]) == {"trainer"}
          and _is_dict(launch["config"]["trainer"]))
    if not ok:
        raise CheckpointError(f"checkpoint {path}: 'launch' must be null or an object with 'config_file', "
                              f"'config' (a trainer: section) and 'cwd', got {launch!r:.80}.")
    return launch


def counters_of(state: dict[str, Any]) -> dict[str, int]:
    """The run counters of a validated state."""
    return {name: int(state["counters"][name]) for name in COUNTERS}
