"""The epoch loop of ``train()``: buffers of prompts, evaluation cadence, logging at ``env_step``,
checkpoint triggers. The algorithm of a buffer is the trainer family's.

The loop and the trainer meet at one public contract, :mod:`comlrl.engine.schedule`: the loop uses
only what :class:`~comlrl.engine.schedule.LoopTrainer` lists of the trainer (``is_complete``,
``run_schedule``, ``buffer_prompts``, ``eval_due``, ``train_buffer``, ``save_run_checkpoint``, ...),
and offers the trainer only :class:`~comlrl.engine.schedule.TrainingLoop`: :meth:`RunLoop.run_epoch`,
:meth:`RunLoop.checkpoint`, :meth:`RunLoop.log` and ``checkpoint_dir``. ``run()`` hands control to
``trainer.run_schedule(loop, progress)``, which calls back ``loop.run_epoch`` for every epoch
(with a multi-phase family's phases around them); ``tests/test_contract.py`` checks both sides.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from . import distributed as dist
from ..exceptions import ConfigError, TrackerError, TrainingError
from ..tracking import Tracker
from .timing import PhaseTimer

if TYPE_CHECKING:
    from .schedule import EpochSchedule, LoopTrainer

__all__ = ["RunLoop", "check_train_args"]

logger = logging.getLogger("comlrl")


def _is_train_row(row: dict[str, Any]) -> bool:
    return not any(k.startswith("eval/") for k in row)


class RunLoop:
    """One call of ``train()``: opens the checkpoint directory and trackers, trains, closes them."""

    def __init__(self, trainer: "LoopTrainer", checkpoint_dir: Optional[os.PathLike], interval: int,
                 limit: Optional[int], save_steps: Optional[int], resumed_number: Optional[int], continuing: bool):
        self.t, self.args = trainer, trainer.args
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.interval, self.limit, self.save_steps = interval, limit, save_steps
        self.resumed_number, self.continuing = resumed_number, continuing
        self.trackers: list[Tracker] = []  # report_to's, on the main process only
        self.failures: list[tuple[str, str, Exception]] = []  # (tracker, what it was doing, error), main only
        self.saved_since_failure: Optional[int] = None  # a checkpoint number written after the first failure
        self.last: dict[str, float] = {}

    # --- opening and closing --------------------------------------------------------------
    @contextlib.contextmanager
    def _opened(self) -> Iterator[None]:
        t = self.t
        success = False
        try:
            if self.checkpoint_dir is not None:
                dist.main_process_first_result(
                    lambda: t.checkpoints.open(self.checkpoint_dir, t.run_id, self.resumed_number), t.dist)
            dist.main_process_first_result(self._open_sinks, t.dist)  # a failure stops every rank
            yield
            dist.main_process_first_result(t.checkpoints.wait, t.dist)  # the last checkpoint is on disk
            self._raise_tracker_failure()
            success = True
        finally:
            self._close(success)

    def _open_sinks(self) -> None:
        folder = self.checkpoint_dir if self.checkpoint_dir is not None else self.t.outputs_dir
        self.trackers = self.t.open_run_trackers(folder, resumed=self.continuing, keep_at_boundary=_is_train_row)

    def _sync_trackers(self) -> None:
        """Before a checkpoint: the rows up to it survive a crash or a power cut."""
        self._to_trackers("syncing before a checkpoint", lambda tracker: tracker.sync())

    # --- a tracker that fails never costs a checkpoint -----------------------------------------
    def _to_trackers(self, what: str, call: Callable[[Tracker], None]) -> None:
        """``call`` every tracker; one that fails is set aside (see :meth:`_tracker_failed`)."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - the others, and the checkpoint due now, come first
                self._tracker_failed(tracker, what, exc)

    def _tracker_failed(self, tracker: Tracker, what: str, exc: Exception) -> None:
        """Stop using a failed tracker for the rest of this train() call. With tracker_failure=
        'raise' training stops at :meth:`_raise_tracker_failure`, after the checkpoint due at this
        point; with 'disable' it goes on, said once here."""
        self.trackers.remove(tracker)
        self.failures.append((tracker.name, what, exc))
        try:
            tracker.close(success=False)
        except Exception:  # noqa: BLE001 - it is failing already
            logger.debug("comlrl: closing the failed tracker %s failed too", tracker.name, exc_info=True)
        if self.args.tracker_failure == "disable":
            logger.warning("comlrl: tracker %s failed %s (%s: %s); training goes on without it until train() returns "
                           "(tracker_failure='disable'): its run misses the rows from here on, which the other "
                           "trackers hold.", tracker.name, what, type(exc).__name__, exc)

    def _failure_message(self) -> Optional[str]:
        if not self.failures:
            return None
        name, what, exc = self.failures[0]
        saved = (f"checkpoint-{self.saved_since_failure} was written first" if self.saved_since_failure is not None
                 else "the last checkpoint is intact")
        return (f"tracker {name!r} failed {what}: {type(exc).__name__}: {exc}. Training stopped; {saved}. Make the "
                "tracker work again and resume from the newest checkpoint (its run continues from there; the row it "
                "failed to record is in the other trackers), or set tracker_failure='disable' to train on without a "
                "failing tracker.")

    def _raise_tracker_failure(self) -> None:
        """With tracker_failure='raise', stop (every process) once a tracker has failed."""
        if self.args.tracker_failure != "raise":
            return
        message = dist.main_process_first_result(self._failure_message, self.t.dist)
        if message is not None:
            dist.main_process_first_result(self.t.checkpoints.wait, self.t.dist)  # "written first": on disk
            raise TrackerError(message) from (self.failures[0][2] if self.failures else None)

    def _close(self, success: bool) -> None:
        t = self.t
        try:
            if t.dist.is_main:
                try:
                    t.checkpoints.release()
                except Exception:  # already failing: log the write's error rather than hide the first one
                    logger.exception("comlrl: writing the last checkpoint failed")
        finally:
            self._close_trackers(success)

    def _close_trackers(self, success: bool) -> None:
        """Close every tracker, even when one fails; a failure is raised only if training succeeded
        (otherwise training's own error is the one to see)."""
        first: Optional[BaseException] = None
        trackers, self.trackers = self.trackers, []
        # How each tracker logged (W&B: "offline"), for the summary of a command line
        self.t.tracker_notes = {tr.name: str(getattr(tr, "note", lambda: "")()) for tr in trackers}
        for tracker in trackers:
            try:
                tracker.close(success=success)
            except Exception as exc:  # noqa: BLE001 - the others must still be closed
                logger.exception("comlrl: closing tracker %s failed", tracker.name)
                first = first or exc
        if first is not None and success:
            raise first

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        """Train (``trainer.run_schedule``) between opening and closing the checkpoint directory and
        trackers; returns the last logged row (``{}`` when the run was complete already)."""
        t = self.t
        if t.is_complete():
            logger.warning("comlrl: %d epoch(s) are already complete and num_train_epochs=%d; nothing to train. "
                           "Raise num_train_epochs to continue the run.", t.state.epoch, self.args.num_train_epochs)
            return {}
        with self._opened(), self._progress() as progress:
            t.run_schedule(self, progress)
        return self.last

    def checkpoint(self) -> None:
        """Save a checkpoint now (a family's phase boundary), when the run has a checkpoint_dir."""
        if self.checkpoint_dir is None:
            return
        self._save_now()
        self._raise_tracker_failure()

    def _save_now(self) -> None:
        """The next checkpoint, now: trackers synced first, its cost (copying the state; the files
        are written in the background) counted in the next logged row."""
        self._sync_trackers()
        timer = PhaseTimer(self.t.device)
        with timer("checkpoint"):
            self.t.save_run_checkpoint(self.t.state.checkpoint + 1, self.limit)
        self._saved()
        self.t.state.window.add(timer.metrics())

    def _saved(self) -> None:
        if self.failures and self.saved_since_failure is None:
            self.saved_since_failure = self.t.state.checkpoint

    def log(self, metrics: dict[str, float], flush: bool = False) -> None:
        """Log a family's phase metrics (e.g. reward-model training) at the current env_step."""
        self._log(metrics, self.t.epoch_position(0.0), flush=flush)

    def run_epoch(self, progress: Any, schedule: Optional[EpochSchedule] = None) -> None:
        """Train the rest of the current epoch, buffer by buffer, on ``schedule``'s buffers (the
        trainer's by default; see :meth:`comlrl.engine.schedule.TrainingLoop.run_epoch`): what
        ``run_schedule`` calls."""
        t = self.t
        s = t if schedule is None else schedule
        epoch, order = t.state.epoch, s.epoch_order(t.state.epoch)
        if not 0 <= t.state.items_in_epoch < len(order):
            # Never spin: an epoch that cannot advance is a bad counter (a forged or foreign
            # checkpoint) or an empty epoch order, both errors to name.
            raise TrainingError(f"epoch {epoch + 1} cannot make progress: items_in_epoch is {t.state.items_in_epoch}, "
                                f"while the epoch has {len(order)} prompt(s). A resumed checkpoint whose counters do "
                                "not fit this dataset was edited or belongs to another setup; resume from another "
                                "checkpoint.")
        while True:
            start = t.state.items_in_epoch
            indices = order[start:start + s.buffer_prompts()]
            if not indices:
                raise TrainingError(f"epoch {epoch + 1}: a buffer of {s.buffer_prompts()} prompt(s) at prompt {start} "
                                    f"of {len(order)} holds none; training would make no progress.")
            self._evaluate_if_due(s, start, len(indices), len(order))
            self._raise_tracker_failure()
            steps_before = t.state.global_step
            timer = PhaseTimer(t.device)
            metrics = s.train_buffer(indices, epoch, timer)
            metrics.update(timer.metrics())
            t.state.items_in_epoch += len(indices)
            done = t.state.items_in_epoch == len(order)
            if done:
                t.state.epoch, t.state.items_in_epoch = epoch + 1, 0
            self._log(metrics, t.epoch_position(epoch + (start + len(indices)) / len(order)), flush=done)
            progress.update(t.state.global_step - steps_before)
            progress.set_postfix(epoch=epoch + 1, reward=f"{metrics.get('train/reward_mean', math.nan):.3f}")
            self._checkpoint_if_due(done, steps_before)
            self._raise_tracker_failure()  # after the checkpoint due here: a failing tracker never costs it
            if done:
                return

    def _evaluate_if_due(self, schedule: EpochSchedule, start: int, count: int, size: int) -> None:
        """CoMLRL's cadence: before training prompt i of an epoch when ``i % eval_interval == 0``
        (a family may count otherwise: :meth:`Trainer.eval_due`, or its phase's ``schedule``)."""
        if self.t.eval_dataset is None or not schedule.eval_due(start, count):
            return
        timer = PhaseTimer(self.t.device)
        with timer("eval"):
            evaluation = self.t.evaluate()
        evaluation.update(timer.metrics())
        self._write_row({**evaluation, "epoch": round(self.t.epoch_position(self.t.state.epoch + start / size), 6)})

    def _log(self, metrics: dict[str, float], epoch: float, flush: bool) -> None:
        """Add a buffer's metrics to the window; write a row once ``env_step`` has moved
        ``logging_steps`` past the last one (CoMLRL's cadence; the first row always), and at the end
        of every epoch (so the last steps of a run are never left unlogged)."""
        state = self.t.state
        state.window.add(metrics)
        last = state.last_logged_env_step
        if not flush and last >= 0 and state.env_step - last < self.args.logging_steps:
            return
        row = state.window.means()
        for key in ("train/reward_min", "train/reward_max"):  # extremes stay extremes (last buffer's)
            if key in metrics:
                row[key] = metrics[key]
        state.window.clear()
        state.last_logged_env_step = state.env_step
        self.last = self._write_row({**row, "epoch": round(epoch, 6)})

    def _write_row(self, row: dict[str, float]) -> dict[str, float]:
        t = self.t
        row = {**row, "env_step": t.state.env_step, "global_step": t.state.global_step}
        self._to_trackers(f"logging the row at env_step {t.state.env_step}",
                          lambda tracker: tracker.log(row, step=t.state.env_step))
        return row

    def _checkpoint_if_due(self, epoch_done: bool, steps_before: int) -> None:
        t = self.t
        if self.checkpoint_dir is None:
            return
        due = epoch_done and (t.state.epoch % self.interval == 0 or t.state.epoch == self.args.num_train_epochs)
        if self.save_steps is not None and not epoch_done:
            due = t.state.global_step // self.save_steps > steps_before // self.save_steps
        if due:
            self._save_now()

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Any]:
        from tqdm.auto import tqdm

        t = self.t
        disable = not t.verbose or not t.dist.is_main or os.environ.get("COMLRL_DISABLE_PROGRESS") == "1"
        bar = tqdm(total=t.total_steps(), initial=t.state.global_step, desc=t.algorithm_name, unit="step",
                   dynamic_ncols=True, disable=disable)
        try:
            yield bar
        finally:
            bar.close()


def check_train_args(checkpoint_dir: Any, interval: Any, limit: Any, save_steps: Any) -> None:
    if checkpoint_dir is None and (limit is not None or save_steps is not None):
        raise ConfigError("checkpoint_total_limit / save_steps need a checkpoint_dir.")
    for name, value, optional in (("checkpoint_interval", interval, False), ("checkpoint_total_limit", limit, True),
                                  ("save_steps", save_steps, True)):
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}.")
