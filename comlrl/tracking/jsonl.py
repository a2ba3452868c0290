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

from .._io import atomic_write_text, open_regular, read_regular, refuse_link
from ..exceptions import CheckpointDirError

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
            are dropped first (they are redone). A file that holds anything else (another run's
            rows: a resume from another directory into a shared ``output_dir``) is never cut: it
            is kept whole as on a fresh run, and the new file starts with this run's rows.
        keep_at_boundary: which rows logged at exactly ``keep_until_step`` to keep (those logged
            after the checkpoint at that step are redone).
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike, run_id: Optional[str] = None, keep_until_step: Optional[int] = None,
                 keep_at_boundary: Callable[[dict[str, Any]], bool] = lambda row: True):
        self.run_id = run_id
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(self.path, "the metrics file", CheckpointDirError)
        kept: list[str] = []
        if os.path.lexists(self.path):
            lines = read_regular(self.path, "the metrics file", CheckpointDirError).decode(
                "utf-8", errors="replace").splitlines()
            foreign = True
            if keep_until_step is not None:
                kept, foreign = _rows_of_run(lines, run_id, keep_until_step, keep_at_boundary)
            if foreign and self.path.stat().st_size > 0:
                self._set_aside(resumed=keep_until_step is not None)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND, "the metrics file", CheckpointDirError)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def _set_aside(self, resumed: bool) -> None:
        """Keep a file this run did not write (all of it) as ``metrics.<time>.jsonl`` beside it."""
        kept_as = _free_name(self.path)
        os.replace(self.path, kept_as)
        if resumed:
            logger.warning("comlrl: %s holds rows of another run; it was kept as %s, and this run's rows up to the "
                           "checkpoint start a new %s", self.path, kept_as, self.path.name)
        else:
            logger.warning("comlrl: starting a fresh run; the earlier run's %s was kept as %s", self.path.name,
                           kept_as)

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


def _rows_of_run(lines: list[str], run_id: Optional[str], until: int,
                 keep_at_boundary: Callable[[dict[str, Any]], bool]) -> tuple[list[str], bool]:
    """The lines of run ``run_id`` up to step ``until`` (its later rows are redone work), and
    whether the file holds anything else (another run's rows, or text that is not a row; a last
    line cut short by a crash is this run's)."""
    kept, foreign = [], False
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            foreign = foreign or number < len(lines)
            continue
        if not isinstance(row, dict) or row.get("run_id") != run_id:
            foreign = True
            continue
        step = row.get("env_step", math.inf)
        if not isinstance(step, (int, float)):
            foreign = True
        elif step < until or (step == until and keep_at_boundary(row)):
            kept.append(line)
    return kept, foreign


def _free_name(path: Path) -> Path:
    """``metrics.<YYYYmmdd-HHMMSS>[-n].jsonl`` beside ``path``, not yet taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    for n in range(1000):
        candidate = path.with_name(f"{path.stem}.{stamp}{'' if n == 0 else f'-{n}'}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise FileExistsError(f"no free name to keep {path} under")
