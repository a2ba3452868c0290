"""Which trackers a run logs to (``report_to``, TRL's convention) and the one interface they share.

Every destination of metric rows is a :class:`Tracker`: ``metrics.jsonl`` (``"jsonl"``), W&B
(``"wandb"``), TensorBoard (``"tensorboard"``) and MLflow (``"mlflow"``). The training loop opens
them with :func:`open_trackers`, hands each logged row to all of them, syncs them before a
checkpoint and closes them; it never knows which ones there are.

Resuming, every tracker continues the same run and shows every step once (see docs/tracking.md):
a tracker is opened with ``resume_step``, the checkpoint's ``env_step``. Rows up to it were logged
before the checkpoint; rows after it that an interrupted run logged are replaced by the redone
work (``metrics.jsonl``, TensorBoard) or, where the store is append-only (MLflow), kept and not sent
again.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from .._imports import install_hint
from .._redact import redact_text
from ..exceptions import CheckpointDirError, CheckpointError, ComlrlError, ConfigError, TrackerError

__all__ = ["Tracker", "TrackerContext", "TRACKERS", "check_report_to", "check_report_to_installed",
           "active_trackers", "open_trackers", "check_tracker_identities", "INSTALL_HINTS"]

logger = logging.getLogger("comlrl")

# The order rows are handed over in: local files first, so a remote tracker that fails leaves them whole.
TRACKERS = ("jsonl", "tensorboard", "mlflow", "wandb")
# Trackers that need a package comlrl does not depend on: (module, pip extra).
INSTALL_HINTS = {"tensorboard": ("tensorboard", install_hint("tensorboard")),
                 "mlflow": ("mlflow", install_hint("mlflow"))}


@runtime_checkable
class Tracker(Protocol):
    """Where metric rows go. ``row`` holds ``env_step``, ``global_step``, ``epoch`` and the metrics;
    ``step`` is the row's ``env_step``, the x axis of every tracker."""

    name: str

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """Record one row at ``step`` (steps never decrease within a run; several rows may share one)."""

    def sync(self) -> None:
        """Make the rows logged so far durable: called before every checkpoint, whose ``env_step``
        promises that they exist."""

    def close(self, success: bool = True) -> None:
        """Flush and release; ``success`` is False when training stopped with an exception."""

    def identity(self) -> Optional[dict[str, str]]:
        """What a resumed run needs to continue this tracker's run (plain strings, saved in every
        checkpoint), or None when the tracker needs nothing."""


# --- report_to ---------------------------------------------------------------------------------

def _installed(name: str) -> bool:
    module = INSTALL_HINTS.get(name, (name, ""))[0]
    return importlib.util.find_spec(module) is not None


def check_report_to(name: str, value: Any) -> Optional[list[str]]:
    """``report_to`` as a list of tracker names (a config field check).

    None stays None (jsonl, plus W&B when the trainer gets a ``wandb_config``); ``"none"`` becomes
    ``[]``; ``"all"`` becomes ``jsonl``, ``wandb`` and every other tracker whose package is
    installed; a name or a list of names is lower-cased, deduplicated, in the given order.
    """
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(v, str) for v in names):
        raise ConfigError(f"{name} must be None, a tracker name or a list of them ({', '.join(TRACKERS)}, 'all', "
                          f"'none'), got {value!r}.")
    names = list(dict.fromkeys(v.strip().lower() for v in names))
    unknown = [v for v in names if v not in TRACKERS + ("all", "none")]
    if unknown:
        raise ConfigError(f"{name}: unknown tracker(s) {unknown}; choose among {', '.join(map(repr, TRACKERS))}, "
                          "'all' or 'none'.")
    if ("all" in names or "none" in names) and len(names) > 1:
        raise ConfigError(f"{name}: 'all' and 'none' stand alone, got {value!r}.")
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [t for t in TRACKERS if t not in INSTALL_HINTS or _installed(t)]
    return names


def check_report_to_installed(report_to: Optional[Sequence[str]]) -> None:
    """Raise :class:`ConfigError` naming the install command of every tracker whose package is missing."""
    for tracker in report_to or ():
        if tracker in INSTALL_HINTS and not _installed(tracker):
            raise ConfigError(f"report_to includes {tracker!r}, but the {INSTALL_HINTS[tracker][0]} package is not "
                              f"installed: {INSTALL_HINTS[tracker][1]}, or leave {tracker!r} out of report_to.")


def active_trackers(report_to: Optional[Sequence[str]], wandb_config: Optional[Mapping[str, Any]]) -> list[str]:
    """The trackers of a run, in :data:`TRACKERS` order. ``report_to=None`` keeps CoMLRL's behaviour:
    ``metrics.jsonl`` always, W&B exactly when a ``wandb_config`` is given."""
    if report_to is None:
        names = {"jsonl"} | ({"wandb"} if wandb_config is not None else set())
    else:
        names = set(report_to)
        if wandb_config is not None and "wandb" not in names:
            logger.warning("comlrl: a wandb_config is given but report_to=%s leaves W&B out; not logging to W&B.",
                           list(report_to))
    return [t for t in TRACKERS if t in names]


# --- identities saved in checkpoints -------------------------------------------------------------

def check_tracker_identities(value: Any, where: str) -> dict[str, dict[str, str]]:
    """The ``trackers`` field of a checkpoint's state: ``{tracker: identity}`` of trackers other
    than W&B (whose identity has its own field, CoMLRL's ``wandb``). Missing (a checkpoint written
    before trackers were saved) is ``{}``. Only known trackers, each identity checked by its own
    rule (plain id strings): a checkpoint can never steer where metrics are sent.
    """
    from .mlflow import check_mlflow_identity

    checks: dict[str, Callable[[Any, str], Optional[dict[str, str]]]] = {"mlflow": check_mlflow_identity}
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: 'trackers' must be an object, got {type(value).__name__}.")
    unknown = sorted(set(value) - set(checks))
    if unknown:
        raise CheckpointError(f"{where}: 'trackers' holds unknown tracker(s) {unknown}; only {sorted(checks)} "
                              "identities are saved.")
    out = {}
    for name, identity in value.items():
        checked = checks[name](identity, where)
        if checked is not None:
            out[name] = checked
    return out


# --- opening -----------------------------------------------------------------------------------

@dataclass
class TrackerContext:
    """What opening the trackers of one ``train()`` call needs.

    Attributes:
        folder: the checkpoint_dir (or the config's output_dir): ``metrics.jsonl`` and, by
            default, ``tensorboard/`` go here.
        run_id: the comlrl run id (32 hex digits), the same across resumes.
        resume_step: None for a fresh run; continuing a run, the ``env_step`` it continues from.
        run_config: hyper-parameters recorded by W&B (config) and MLflow (params) for a new run.
        identities: saved identities by tracker name (``"wandb"``, ``"mlflow"``), or None each.
        keep_at_boundary: which ``metrics.jsonl`` rows logged at exactly ``resume_step`` to keep.
    """

    folder: Path
    run_id: str
    resume_step: Optional[int]
    run_config: dict[str, Any] = field(default_factory=dict)
    identities: Mapping[str, Optional[dict[str, str]]] = field(default_factory=dict)
    keep_at_boundary: Callable[[dict[str, Any]], bool] = lambda row: True


def open_trackers(names: Sequence[str], args: Any, wandb_config: Optional[Mapping[str, Any]],
                  ctx: TrackerContext) -> list[Tracker]:
    """Open the trackers ``names`` (see :func:`active_trackers`); if one fails, those already open
    are closed and the error is raised."""
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_open(name, args, wandb_config, ctx))
    except BaseException:
        for tracker in reversed(opened):
            try:
                tracker.close(success=False)
            except Exception:  # noqa: BLE001 - the opening error is the one to report
                logger.exception("comlrl: closing tracker %s failed", tracker.name)
        raise
    return opened


def _open(name: str, args: Any, wandb_config: Optional[Mapping[str, Any]], ctx: TrackerContext) -> Tracker:
    if name == "jsonl":
        from .jsonl import JsonlSink

        return JsonlSink(ctx.folder / "metrics.jsonl", run_id=ctx.run_id, keep_until_step=ctx.resume_step,
                         keep_at_boundary=ctx.keep_at_boundary)
    if name == "wandb":
        from .wandb import WandbSink

        resumed = ctx.resume_step is not None
        return WandbSink(wandb_config or {}, ctx.run_config, identity=ctx.identities.get("wandb") if resumed else None,
                         min_step=ctx.resume_step + 1 if resumed else 0)
    if name == "tensorboard":
        from .tensorboard import TensorBoardTracker

        root = Path(args.tensorboard_dir) if getattr(args, "tensorboard_dir", None) else ctx.folder / "tensorboard"
        if not getattr(args, "tensorboard_dir", None):  # inside the run directory: never through a link
            from .._io import refuse_link

            refuse_link(root, "the TensorBoard root", CheckpointDirError)
        return TensorBoardTracker(root / f"run-{ctx.run_id[:8]}", resume_step=ctx.resume_step)
    if name == "mlflow":
        from .mlflow import MlflowTracker

        try:
            return MlflowTracker(tracking_uri=args.mlflow_tracking_uri, experiment_name=args.mlflow_experiment_name,
                                 run_name=args.mlflow_run_name, run_config=ctx.run_config, comlrl_run_id=ctx.run_id,
                                 identity=ctx.identities.get("mlflow"), resume_step=ctx.resume_step)
        except ComlrlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store that refuses (read-only, unreachable): say what to change
            where = args.mlflow_tracking_uri or "MLflow's default store (MLFLOW_TRACKING_URI or ./mlruns)"
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise TrackerError(redact_text(f"MLflow could not open a run at {where}: {type(exc).__name__}: {first}. "
                                           "Nothing was trained; make the store reachable and writable "
                                           "(mlflow_tracking_uri) or leave 'mlflow' out of report_to.")) from None
    raise ConfigError(f"unknown tracker {name!r}")
