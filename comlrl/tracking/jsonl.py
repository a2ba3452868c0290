"""``metrics.jsonl``: one JSON object per logged row, with resume-aware step semantics.

Every row carries ``env_step``. On resume the file keeps only the rows up to the checkpoint's
``env_step`` (the rows an interrupted run wrote after it are replaced by the redone work, never
duplicated). Rows are strict JSON: non-finite numbers are written as ``null``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .._io import atomic_write_text

logger = logging.getLogger("comlrl")

__all__ = ["JsonlSink", "strict_json"]


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, so that ``json.dumps`` writes
    strict JSON (no bare ``NaN`` / ``Infinity`` tokens)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class JsonlSink:
    """Appends one JSON object per logged row to ``path`` (the ``"jsonl"`` tracker of ``report_to``).

    Args:
        path: the file (parents are created).
        run_id: written into every row; on resume only this run's rows are kept.
        keep_until_step: None for a fresh run: a non-empty file of an earlier run is kept, renamed
            to ``metrics.<time>.jsonl`` beside it (and said so), and a new file is started; on
            resume, the checkpoint's ``env_step``: this run's rows with a larger ``env_step``
            are dropped first.
        keep_at_boundary: which rows logged at exactly ``keep_until_step`` to keep (those logged
            after the checkpoint at that step are redone).
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike, run_id: Optional[str] = None, keep_until_step: Optional[int] = None,
                 keep_at_boundary: Callable[[dict[str, Any]], bool] = lambda row: True):
        self.run_id = run_id
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if keep_until_step is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if not isinstance(row, dict) or row.get("run_id") != run_id:
                    continue
                step = row.get("env_step", math.inf)
                if step < keep_until_step or (step == keep_until_step and keep_at_boundary(row)):
                    kept.append(line)
        elif self.path.exists() and self.path.stat().st_size > 0:
            kept_as = _free_name(self.path)
            os.replace(self.path, kept_as)
            logger.warning("comlrl: starting a fresh run; the earlier run's %s was kept as %s", self.path.name,
                           kept_as)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, row: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Append ``row`` (which carries its own ``env_step``; ``step`` is accepted for the
        :class:`~comlrl.tracking.Tracker` interface)."""
        record = dict(row) if self.run_id is None else {**row, "run_id": self.run_id}
        self._file.write(json.dumps(strict_json(record), sort_keys=True, allow_nan=False) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """fsync: called before a checkpoint, whose env_step promises these rows exist."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, success: bool = True) -> None:
        if not self._file.closed:
            self._file.close()

    def identity(self) -> None:
        """Nothing to save: the file is found by its path and its rows by ``run_id``."""
        return None


def _free_name(path: Path) -> Path:
    """``metrics.<YYYYmmdd-HHMMSS>[-n].jsonl`` beside ``path``, not yet taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    for n in range(1000):
        candidate = path.with_name(f"{path.stem}.{stamp}{'' if n == 0 else f'-{n}'}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"no free name to keep {path} under")
