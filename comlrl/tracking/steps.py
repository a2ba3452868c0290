"""Each step once: which values of a row a tracker still has to record (shared by the trackers
whose store cannot be rewritten, MLflow and TensorBoard)."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Optional

__all__ = ["StepFilter"]

logger = logging.getLogger("comlrl")


class StepFilter:
    """Which ``(key, step)`` values of a row a tracker still has to record, so that each key has
    each step once: not twice within a run (an evaluation row and a training row share a step and
    both carry ``epoch`` and ``global_step``), and not again after a resume when the tracker's store
    already holds it (``present``: ``{key: {step: value}}`` read back from the store).

    A value that differs from the stored one is not sent (the store is not rewritten); a warning
    names it once, since a bit-exact resume redoes the same values (``timing/*`` keys excepted).
    """

    def __init__(self, present: Optional[Mapping[str, Mapping[int, float]]] = None, tracker: str = "",
                 same: Callable[[float, float], bool] = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))):
        self.present = {k: dict(v) for k, v in (present or {}).items()}
        self.last: dict[str, int] = {}
        self.tracker, self.same = tracker, same
        self.differing: list[tuple[str, int]] = []

    def new_values(self, row: Mapping[str, Any], step: int) -> dict[str, float]:
        out = {}
        for key, value in row.items():
            if key == "env_step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            value = float(value)
            if self.last.get(key, -1) >= step:
                continue
            self.last[key] = step
            stored = self.present.get(key, {}).get(step)
            if stored is not None:
                if not key.startswith("timing/") and not self.same(stored, value):
                    self._differs(key, step, stored, value)
                continue
            out[key] = value
        return out

    def _differs(self, key: str, step: int, stored: float, value: float) -> None:
        if not self.differing:
            logger.warning("comlrl: %s already holds %s=%r at step %d from before the interruption; the redone run "
                           "gives %r (resume is bit-exact only on CPU). %s keeps the first value; metrics.jsonl holds "
                           "the redone ones.", self.tracker, key, stored, step, value, self.tracker)
        self.differing.append((key, step))
