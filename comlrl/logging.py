"""Metric sinks with resume-aware step semantics: a local JSON-lines file and Weights & Biases.

Every logged row carries ``env_step``. On resume the JSON-lines file keeps only the rows up to the
checkpoint's ``env_step`` (the rows an interrupted run wrote after it are replaced by the redone
work, never duplicated), and W&B is never sent a step it has already recorded.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

from ._io import atomic_write_text

logger = logging.getLogger("comlrl")

__all__ = ["JsonlSink", "WandbSink", "wandb_has_credentials", "check_wandb_config"]

_WANDB_INIT_KEYS = {
    "project", "name", "entity", "id", "resume", "tags", "dir", "group", "job_type", "notes",
    "mode", "config", "resume_from", "fork_from", "save_code", "anonymous", "reinit", "settings",
}


class JsonlSink:
    """Appends one JSON object per logged step to ``path``.

    Args:
        path: the file (parents are created).
        run_id: written into every row; on resume only this run's rows are kept.
        keep_until_step: None for a fresh run (the file is started anew); on resume, the
            checkpoint's ``env_step``: rows with a larger ``env_step`` are dropped first.
    """

    def __init__(self, path: str | os.PathLike, run_id: Optional[str] = None, keep_until_step: Optional[int] = None):
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
                if isinstance(row, dict) and row.get("env_step", math.inf) <= keep_until_step \
                        and row.get("run_id") == run_id:
                    kept.append(line)
        elif self.path.exists():
            logger.warning("comlrl: starting a fresh run; replacing the old metrics file %s", self.path)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, row: Mapping[str, Any]) -> None:
        record = dict(row) if self.run_id is None else {**row, "run_id": self.run_id}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """fsync: called before a checkpoint, whose env_step promises these rows exist."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def check_wandb_config(wandb_config: Any) -> Optional[dict[str, Any]]:
    """Validate a ``wandb_config`` when the trainer is built; returns a copy (or None)."""
    from .exceptions import ConfigError

    if wandb_config is None:
        return None
    if not isinstance(wandb_config, Mapping):
        raise ConfigError(f"wandb_config must be a dict of wandb.init arguments or None, got {type(wandb_config).__name__}.")
    unknown = sorted(set(wandb_config) - _WANDB_INIT_KEYS)
    if unknown:
        raise ConfigError(f"wandb_config has unknown key(s) {unknown}; known: {sorted(_WANDB_INIT_KEYS)}.")
    return dict(wandb_config)


def wandb_has_credentials() -> bool:
    """True if W&B could log in without asking: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbSink:
    """One W&B run, initialised once, never prompting.

    With no credentials (and no explicit ``mode`` / ``WANDB_MODE``) the run is offline, announced
    once with the command that uploads it later.

    Args:
        wandb_config: keyword arguments for ``wandb.init`` (``project``, ``name``, ``entity``, ``id``,
            ``resume``, ``tags``, ``dir``, ...). Unknown keys raise ``ConfigError``.
        run_config: the hyper-parameters recorded in the run's config.
        min_step: steps below this are not sent (W&B would drop them anyway, with a warning).
    """

    def __init__(self, wandb_config: Mapping[str, Any], run_config: Mapping[str, Any], min_step: int = 0):
        import wandb

        kwargs = check_wandb_config(wandb_config) or {}
        kwargs.setdefault("project", "comlrl")
        kwargs["config"] = {**dict(run_config), **dict(kwargs.get("config") or {})}
        if "mode" not in kwargs and not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
            kwargs["mode"] = "offline"
            logger.warning(
                "comlrl: no W&B credentials found (WANDB_API_KEY or `wandb login`); logging offline. "
                "Upload later with `wandb sync <dir>/wandb/offline-run-*`."
            )
        self._wandb = wandb
        self.run = wandb.init(**kwargs)
        self.offline = bool(getattr(self.run.settings, "_offline", False)) or kwargs.get("mode") == "offline" \
            or os.environ.get("WANDB_MODE") == "offline"
        # A resumed online run knows the next step it accepts; never send one below it.
        self.min_step = max(min_step, int(getattr(self.run, "step", 0) or 0))

    def identity(self) -> dict[str, Any]:
        """``{"id", "project", "entity"}``: what ``wandb.init`` needs to continue this run."""
        identity = {"id": self.run.id, "project": self.run.project}
        entity = getattr(self.run, "entity", None)
        if entity:
            identity["entity"] = entity
        return identity

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if step < self.min_step:
            return
        self.run.log(dict(metrics), step=step)
        self.min_step = step + 1

    def close(self) -> None:
        if self.offline:
            run_dir = str(Path(self.run.dir).parent)  # run.dir is the run's files/ folder
            logger.warning("comlrl: W&B run %s was logged offline in %s; upload it with `wandb sync %s`.",
                           self.run.id, run_dir, run_dir)
        self.run.finish()
