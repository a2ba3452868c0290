"""The contract between the run loop (:class:`comlrl.engine.loop.RunLoop`) and a trainer.

One call of ``train()`` builds a :class:`~comlrl.engine.loop.RunLoop` and hands it the trainer.
They meet here, in two protocols, and nowhere else: the loop uses no trainer attribute that
:class:`LoopTrainer` does not list, and a trainer uses no loop attribute that :class:`TrainingLoop`
does not list (``tests/test_contract.py`` reads both sides and checks it)::

    Trainer.train()
      -> RunLoop.run()                       loop: opens the checkpoint directory and trackers
           trainer.is_complete()             nothing to do? (then run() returns {})
           trainer.open_run_trackers(...)
           trainer.total_steps()             the progress bar's length
           trainer.run_schedule(loop, progress)
             loop.run_epoch(progress[, schedule])   per epoch; schedule: the trainer, or a
                                             phase's EpochSchedule (MARLHF's online phase)
               per buffer of schedule.buffer_prompts() prompts of schedule.epoch_order(epoch):
                 schedule.eval_due(start, count) -> trainer.evaluate()
                 schedule.train_buffer(indices, epoch, timer) -> metrics
                 log at env_step (row's epoch: trainer.epoch_position(...))
                 checkpoint when due -> trainer.save_run_checkpoint(number, limit)
             loop.log(metrics) / loop.checkpoint()   a family's phase boundary (MADPO, MARLHF)
      <- the last logged row                 loop: waits for the last checkpoint, closes

:class:`comlrl.engine.trainer.Trainer` implements every :class:`LoopTrainer` method; a family
overrides the ones its schedule changes (``train_buffer`` always, through ``collect`` and
``optimizer_step`` or directly; MADPO and MARLHF also ``run_schedule``, ``is_complete``,
``total_steps`` and ``eval_due``). A family whose phases train on different buffers runs each
phase's epochs with that phase's :class:`EpochSchedule` (MARLHF's online phase: its inner
trainer's buffers), so the trainer's own methods never switch on the phase.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..checkpoint.manager import CheckpointManager
    from ..tracking import Tracker
    from .distributed import DistContext
    from .settings import TrainerConfig
    from .state import TrainState
    from .timing import PhaseTimer

__all__ = ["EpochSchedule", "LoopTrainer", "TrainingLoop"]


@runtime_checkable
class TrainingLoop(Protocol):
    """What the run loop offers a trainer's :meth:`LoopTrainer.run_schedule`: epochs, saving,
    logging. Nothing else of the loop is a trainer's to use."""

    #: The run's checkpoint directory (``train(checkpoint_dir=...)``), or None when it has none.
    checkpoint_dir: Optional[Path]

    def run_epoch(self, progress: Any, schedule: "Optional[EpochSchedule]" = None) -> None:
        """Train the rest of the current epoch (``trainer.state.epoch``), buffer by buffer, from
        ``state.items_in_epoch``: evaluate when due, train the buffer, log, checkpoint when due.
        Returns once the epoch is done (``state.epoch`` is then one more). ``progress`` is the
        bar the loop passed to ``run_schedule``. ``schedule`` (default: the trainer) is what the
        epoch's buffers come from and are trained by: a phase of a multi-phase family (MARLHF's
        online phase) passes its own."""
        ...

    def checkpoint(self) -> None:
        """Save a checkpoint now, when the run has a checkpoint_dir (a family's phase boundary)."""
        ...

    def log(self, metrics: dict[str, float], flush: bool = False) -> None:
        """Log a family's phase metrics (reward-model training, a pair set) at the current
        ``env_step``: added to the window of the next row (``flush=True``: a row now)."""
        ...


@runtime_checkable
class EpochSchedule(Protocol):
    """What one epoch of buffers is made of and trained by: the trainer's own (every
    :class:`LoopTrainer` is one), or a phase's that a multi-phase family hands to
    ``loop.run_epoch(progress, schedule)``. The state the loop advances, evaluation and logging
    stay the trainer's."""

    def epoch_order(self, epoch: int) -> list[int]:
        """The items (dataset rows, pairs) of ``epoch`` in training order; called at the start of
        every ``run_epoch`` (a pure function of the seed and the epoch)."""
        ...

    def buffer_prompts(self) -> int:
        """How many items of the epoch order one buffer takes; called for every buffer."""
        ...

    def eval_due(self, start: int, count: int) -> bool:
        """Whether to evaluate before the buffer of items ``start .. start + count`` of the epoch;
        called before every buffer when there is an eval_dataset."""
        ...

    def train_buffer(self, indices: list[int], epoch: int, timer: "PhaseTimer") -> dict[str, float]:
        """Train on one buffer (``indices`` into the epoch's items) of ``epoch``, timing phases with
        ``timer``; advances ``state.global_step`` / ``state.env_step`` and returns the buffer's
        metrics. The loop then advances ``state.items_in_epoch`` (and ``state.epoch``), logs and
        checkpoints when due."""
        ...


@runtime_checkable
class LoopTrainer(EpochSchedule, Protocol):
    """What the run loop needs from a trainer: every attribute and method the loop uses, public
    (with :class:`EpochSchedule`'s). :class:`comlrl.engine.trainer.Trainer` provides all of them;
    the methods are the schedule hooks a family may override."""

    # --- what the loop reads (and tracker_notes, which it writes) ------------------------------------
    args: "TrainerConfig"                 #: the config (num_train_epochs, logging_steps, tracker_failure)
    state: "TrainState"                   #: the counters the loop advances and logs (epoch, env_step, ...)
    dist: "DistContext"                   #: the process group (the loop's collectives, the main process)
    device: Any                           #: the device phase timers synchronise
    checkpoints: "CheckpointManager"      #: opened, waited on and released by the loop
    run_id: str                           #: the run's id (its checkpoint directory's owner)
    eval_dataset: Any                     #: None: the loop never evaluates
    verbose: bool                         #: whether the progress bar shows
    algorithm_name: str                   #: the progress bar's label
    tracker_notes: dict[str, str]         #: set by the loop on closing: how each tracker logged

    @property
    def outputs_dir(self) -> Path:
        """Where ``metrics.jsonl`` goes when the run has no checkpoint_dir."""
        ...

    # --- the schedule ------------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """Whether the run's work is all done; ``RunLoop.run`` calls it first and, when True,
        trains nothing and returns ``{}``."""
        ...

    def run_schedule(self, loop: TrainingLoop, progress: Any) -> None:
        """The run's work, called once by ``RunLoop.run`` between opening and closing the
        checkpoint directory and trackers: ``loop.run_epoch(progress)`` until every epoch is done,
        with a multi-phase family's own phases (``loop.log``, ``loop.checkpoint``) around them."""
        ...

    def total_steps(self) -> Optional[int]:
        """Optimizer steps of the whole run, the progress bar's length (None: not known up front);
        called once, when the bar is made."""
        ...

    def evaluate(self, num_eval_samples: Optional[int] = None) -> dict[str, float]:
        """The eval metrics (``eval/...``); called with no argument when :meth:`eval_due` says so."""
        ...

    def epoch_position(self, epoch: float) -> float:
        """The ``epoch`` value a logged row shows for position ``epoch`` (epochs and fractions of
        the current schedule; an iterative family counts over its iterations); called per row."""
        ...

    def open_run_trackers(self, folder: os.PathLike, resumed: bool,
                          keep_at_boundary: Callable[[dict[str, Any]], bool]) -> list["Tracker"]:
        """The run's trackers (``report_to``) writing under ``folder``, continuing their runs when
        ``resumed``; called once when the loop opens (on the main process first)."""
        ...

    def save_run_checkpoint(self, number: int, limit: Optional[int]) -> Path:
        """Save ``checkpoint-<number>`` in the opened checkpoint directory, keeping the newest
        ``limit`` (None: all), and return its path; the files are written in the background.
        Called by the loop whenever a checkpoint is due (its trackers synced first)."""
        ...
