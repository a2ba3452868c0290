"""Per-phase wall-clock timers (``timing/rollout``, ``timing/update``, ...)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulates seconds per named phase; synchronises CUDA so GPU work is counted where it runs."""

    #: The clock read (seconds): wall-clock time; a benchmark on a loaded machine may set
    #: ``time.process_time`` (this process's CPU time, every thread's) before the trainer runs.
    clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device | None = None):
        self.seconds: dict[str, float] = {}
        self._sync = device is not None and device.type == "cuda"

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize()
        start = self.clock()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}
