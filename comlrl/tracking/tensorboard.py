"""TensorBoard: one log directory per run (``<root>/run-<run id>``), the same one on resume.

Event files are append-only, so a resumed run cannot remove what an interrupted one wrote after
its checkpoint; it writes a purge marker instead (``SummaryWriter(purge_step=...)``): TensorBoard's
readers drop every event of the directory at or after that step, and the redone rows take their
place. The marker is at ``resume_step + 1`` because the training row at the checkpoint's own step
was logged before the checkpoint and is not redone; the rows at that step that are redone (an
evaluation before the next buffer) are not written again when the directory already holds them.

Needs the ``tensorboard`` package: ``pip install -e ".[tensorboard]"`` in the checkout.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from .._io import own_dir, refuse_link
from ..exceptions import CheckpointDirError
from .steps import StepFilter

__all__ = ["TensorBoardTracker", "read_scalars"]

logger = logging.getLogger("comlrl")


def _as_float32(value: float) -> float:
    """``value`` rounded as TensorBoard stores scalars (float32)."""
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a log directory as TensorBoard shows it (purged events removed):
    ``{tag: [(step, value), ...]}`` in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()[SCALARS]}


def _after_existing_files(log_dir: Path) -> None:
    """Wait, at most a second, until a new event file sorts after every existing one.

    Readers apply a purge marker only to the files before it, in name order; names start with the
    creation second and end with a per-process counter compared as text ("10" < "9"), so a file
    created in the same second as the interrupted run's could sort first and its purge be lost."""
    stamps = [int(p.name.split(".")[3]) for p in log_dir.glob("events.out.tfevents.*")
              if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


def tag_of(key: Any) -> str:
    """``key`` as a tag TensorBoard can write: its event files are UTF-8, so a lone surrogate (a
    metric name built from undecodable bytes) is written as its ``\\udxxx`` escape instead of
    stopping training."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class TensorBoardTracker:
    """Scalars of every row at ``step`` (``env_step``), one tag per metric key.

    Args:
        log_dir: this run's directory (created if missing).
        resume_step: None for a fresh run; continuing a run, the ``env_step`` it continues from:
            events after it are purged and rows at it are not written twice.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, resume_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        refuse_link(self.log_dir, "the TensorBoard folder", CheckpointDirError)
        present: dict[str, dict[int, float]] = {}
        if resume_step is not None and self.log_dir.is_dir():
            for tag, events in read_scalars(self.log_dir).items():
                at = {step: value for step, value in events if step == resume_step}
                if at:
                    present[tag] = at
        self.filter = StepFilter(present, "TensorBoard", same=lambda stored, new: stored == _as_float32(new)
                                 or (math.isnan(stored) and math.isnan(new)))
        own_dir(self.log_dir, "the TensorBoard folder", CheckpointDirError)
        if resume_step is not None:
            _after_existing_files(self.log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for key, value in self.filter.new_values(row, step).items():
            self.writer.add_scalar(tag_of(key), value, global_step=step)

    def sync(self) -> None:
        self.writer.flush()

    def close(self, success: bool = True) -> None:
        self.writer.close()

    def identity(self) -> None:
        """Nothing to save: the directory is named by the run id, which every checkpoint holds."""
        return None
