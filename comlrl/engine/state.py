"""The counters of a run and the metrics window between two logged rows: saved in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, Optional, TypeVar

__all__ = ["TrainState", "LogWindow", "PlayedBuffer"]


@dataclass
class LogWindow:
    """Sums of every metric since the last logged row, and how many steps reported each."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {key: value / self.counts[key] for key, value in sorted(self.sums.items())}

    def clear(self) -> None:
        self.sums, self.counts = {}, {}

    def to_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "counts": dict(self.counts)}


@dataclass
class TrainState:
    """Where a run stands. ``items_in_epoch`` counts the prompts of the current epoch already
    trained on (a buffer is trained on whole, so a checkpoint always falls between buffers)."""

    epoch: int = 0                 # completed epochs
    items_in_epoch: int = 0        # prompts of the current epoch done
    global_step: int = 0           # optimizer steps taken
    env_step: int = 0              # joint actions scored
    checkpoint: int = 0            # number of the last checkpoint saved
    last_logged_env_step: int = -1  # env_step of the last logged row (-1: none yet)
    window: LogWindow = field(default_factory=LogWindow)

    def counters(self) -> dict[str, int]:
        return {"epoch": self.epoch, "items_in_epoch": self.items_in_epoch, "global_step": self.global_step,
                "env_step": self.env_step, "checkpoint": self.checkpoint,
                "last_logged_env_step": self.last_logged_env_step}

    @classmethod
    def restore(cls, counters: Mapping[str, int], window: Optional[Mapping[str, Any]] = None) -> "TrainState":
        state = cls(**{k: int(v) for k, v in counters.items()})
        if window:
            state.window = LogWindow(dict(window["sums"]), dict(window["counts"]))
        return state


#: A family's data in :class:`PlayedBuffer` (its own dataclass; a dict also does).
D = TypeVar("D")


@dataclass
class PlayedBuffer(Generic[D]):
    """A buffer's played episodes and its progress through its optimizer steps.

    ``data`` is the family's: what its optimizer steps need of the buffer, its own dataclass
    (MAGRPO's :class:`~comlrl.trainers.reinforce.GroupBufferData`, the actor-critic family's
    :class:`~comlrl.trainers.actor_critic.ActorCriticBufferData`) or any object, a dict say.
    ``record`` is what the episode metrics need (:func:`comlrl.engine.metrics.record_turns`).
    ``steps`` holds, for each optimizer step of one pass over the buffer, its prompts (positions in
    this process's share, as ``groups`` of ``optimizer_step``); ``steps_done`` counts steps over
    every pass, ``step_metrics`` their metrics.

    Two records of the current optimizer step let train() called again after an interruption redo
    only what is unfinished; both are None between steps:

    * ``step_parts``: the family's, of its own type, for a step that updates modules one after
      another (MAGRPO: each agent's update metrics by agent; MAHAGRPO: a
      :class:`~comlrl.trainers.reinforce.SequentialStepParts`). The family sets it in
      ``optimizer_step``; the engine sets it back to None when the step is counted.
    * ``finished_step``: the engine's, the finished step's metrics, set, read and cleared only by
      :meth:`Trainer.train_buffer <comlrl.engine.trainer.Trainer.train_buffer>`: a step that finished
      before an interruption is counted, not redone."""

    turns: list[Any]
    record: dict[str, Any]
    data: D = field(default_factory=dict)  # type: ignore[assignment]  # a dict is a valid D
    extra_metrics: dict[str, float] = field(default_factory=dict)
    epoch: int = -1
    indices: list[int] = field(default_factory=list)
    steps_done: int = 0
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    steps: list[range] = field(default_factory=list)
    step_parts: Any = None
    finished_step: Optional[dict[str, float]] = None
