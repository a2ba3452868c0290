"""Weights & Biases: one run, resumed across checkpoints, never sent a step twice.

``wandb_config`` takes CoMLRL's keys (``project``, ``entity``, ``name`` / ``run_name``, ``dir``,
``tags``, ``id``, ``resume``, ``config_sections``, and ``output_dir``: not W&B's, CoMLRL 1.4.3's
folder for a run's own outputs, read by the trainer) and ``wandb.init``'s other common ones. The
identity saved in a checkpoint is only ``id``, ``project`` and ``entity``, each a plain string:
a checkpoint can never steer ``wandb.init`` anywhere else (a server URL, a directory, settings).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from .._redact import redact
from ..exceptions import CheckpointError, ConfigError

__all__ = ["WandbSink", "check_wandb_config", "wandb_init_kwargs", "check_identity", "IDENTITY_KEYS",
           "offline_folders"]

logger = logging.getLogger("comlrl")

COMLRL_KEYS = {"project", "entity", "name", "run_name", "dir", "tags", "id", "resume", "config_sections",
               "output_dir"}
PASSTHROUGH_KEYS = {"group", "job_type", "notes", "mode", "config", "resume_from", "fork_from", "save_code",
                    "reinit", "settings"}
IDENTITY_KEYS = ("id", "project", "entity")
_IDENTITY_VALUE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def check_wandb_config(wandb_config: Any) -> Optional[dict[str, Any]]:
    """Validate a ``wandb_config`` when the trainer is built; returns a copy (or None)."""
    if wandb_config is None:
        return None
    if not isinstance(wandb_config, Mapping):
        raise ConfigError(f"wandb_config must be a dict of wandb.init arguments or None, got "
                          f"{type(wandb_config).__name__}.")
    unknown = sorted(set(wandb_config) - COMLRL_KEYS - PASSTHROUGH_KEYS)
    if unknown:
        raise ConfigError(f"wandb_config has unknown key(s) {unknown}; known: {sorted(COMLRL_KEYS | PASSTHROUGH_KEYS)}.")
    sections = wandb_config.get("config_sections")
    if sections is not None and not isinstance(sections, Mapping):
        raise ConfigError(f"wandb_config['config_sections'] must be a dict of dicts, got {type(sections).__name__}.")
    output_dir = wandb_config.get("output_dir")
    if output_dir is not None and (not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir)):
        raise ConfigError(f"wandb_config['output_dir'] must be a folder path (CoMLRL 1.4.3: where the run writes "
                          f"its outputs), got {output_dir!r}.")
    return dict(wandb_config)


def wandb_init_kwargs(wandb_config: Mapping[str, Any], run_config: dict[str, Any]) -> dict[str, Any]:
    """``wandb.init`` keyword arguments from a CoMLRL-style ``wandb_config``.

    ``config_sections`` are merged into ``run_config`` (in place; ``dataset.name`` / ``dataset.type``
    also become ``dataset_name`` / ``dataset_type``), which becomes the run's ``config``; ``dir`` is
    created if missing; ``run_name`` is an alias of ``name``.
    """
    sections = dict(wandb_config.get("config_sections") or {})
    run_config.update(sections)
    dataset = sections.get("dataset")
    if isinstance(dataset, Mapping):
        for key in ("name", "type"):
            if key in dataset:
                run_config[f"dataset_{key}"] = dataset[key]
    kwargs: dict[str, Any] = {"project": wandb_config.get("project"), "entity": wandb_config.get("entity"),
                              "name": wandb_config.get("name", wandb_config.get("run_name")), "config": run_config}
    if wandb_config.get("dir"):
        os.makedirs(wandb_config["dir"], exist_ok=True)
        kwargs["dir"] = wandb_config["dir"]
    if isinstance(wandb_config.get("tags"), list):
        kwargs["tags"] = list(wandb_config["tags"])
    for key in ("id", "resume"):
        if wandb_config.get(key) is not None:
            kwargs[key] = wandb_config[key]
    return kwargs


def verbose_from_wandb_config(wandb_config: Any) -> bool:
    """``config_sections.output.verbose`` (default True): whether progress bars are shown."""
    if not isinstance(wandb_config, Mapping):
        return True
    output = (wandb_config.get("config_sections") or {}).get("output") or {}
    return bool(output.get("verbose", True)) if isinstance(output, Mapping) else True


def check_identity(identity: Any, where: str) -> Optional[dict[str, str]]:
    """A saved tracker identity: None, or ``{"id"[, "project"][, "entity"]}`` of plain strings.

    Anything else (other keys such as ``settings`` or ``dir``, non-strings, odd characters) raises
    :class:`CheckpointError` naming ``where``: a checkpoint must not steer ``wandb.init``.
    """
    if identity is None:
        return None
    if not isinstance(identity, Mapping):
        raise CheckpointError(f"{where}: the W&B identity must be a dict or null, got {type(identity).__name__}.")
    extra = sorted(set(identity) - set(IDENTITY_KEYS))
    if extra:
        raise CheckpointError(f"{where}: the W&B identity holds key(s) {extra}; only {list(IDENTITY_KEYS)} may be "
                              "saved (a checkpoint must not steer wandb.init).")
    if "id" not in identity:
        raise CheckpointError(f"{where}: the W&B identity has no 'id'.")
    for key, value in identity.items():
        if not isinstance(value, str) or not _IDENTITY_VALUE.match(value):
            raise CheckpointError(f"{where}: W&B identity field {key!r} must be a plain name (letters, digits, "
                                  f"'.', '_', '-'), got {value!r:.60}.")
    return {k: identity[k] for k in IDENTITY_KEYS if k in identity}


class WandbSink:
    """One W&B run, never prompting (the ``"wandb"`` tracker of ``report_to``).

    The run starts with the first row logged: a run that fails before it logs anything (a
    refused resume, a reward function that raises) leaves no empty W&B run behind. Its id is
    chosen up front, so the identity saved in a checkpoint is known from the start.

    With no credentials (and no explicit ``mode`` / ``WANDB_MODE``) the run is offline, announced
    once with the command that uploads it later.

    Args:
        wandb_config: the trainer's ``wandb_config``.
        run_config: the hyper-parameters recorded in the run's config.
        identity: a saved run identity to continue (``resume="allow"``), or None.
        min_step: steps below this are not sent (W&B would drop them anyway, with a warning).
    """

    name = "wandb"

    def __init__(self, wandb_config: Mapping[str, Any], run_config: Mapping[str, Any],
                 identity: Optional[Mapping[str, str]] = None, min_step: int = 0):
        import wandb

        config = dict(check_wandb_config(wandb_config) or {})
        if identity and "id" not in config:  # continue the checkpoint's run
            config["id"] = identity["id"]
            for key in ("project", "entity"):
                if key in identity:
                    config.setdefault(key, identity[key])
            config.setdefault("resume", "allow")
        kwargs = wandb_init_kwargs(config, dict(run_config))
        kwargs["project"] = kwargs.get("project") or os.environ.get("WANDB_PROJECT") or "comlrl"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for key in PASSTHROUGH_KEYS - {"config"}:
            if key in config:
                kwargs[key] = config[key]
        if "config" in config:
            kwargs["config"] = {**kwargs["config"], **dict(config["config"])}
        kwargs["config"] = redact(kwargs["config"])  # config_sections and config are the user's: hide secrets there too
        kwargs.setdefault("id", uuid.uuid4().hex[:8])  # W&B's own form (8 lowercase letters and digits)
        if "mode" not in kwargs and not os.environ.get("WANDB_MODE") and not _logged_in(wandb):
            kwargs["mode"] = "offline"
            logger.warning("comlrl: no W&B credentials found (WANDB_API_KEY or `wandb login`); logging offline. "
                           "Upload later with `wandb sync <dir>/wandb/offline-run-*`.")
        self._kwargs = kwargs
        self.run: Any = None
        self.offline = kwargs.get("mode") == "offline" or os.environ.get("WANDB_MODE") == "offline"
        self.min_step = min_step

    def _start(self) -> Any:
        import wandb

        if self.run is None:
            self.run = wandb.init(**self._kwargs)
            self.offline = self.offline or bool(getattr(self.run.settings, "_offline", False))
            # A resumed online run knows the next step it accepts; never send one below it.
            self.min_step = max(self.min_step, int(getattr(self.run, "step", 0) or 0))
        return self.run

    def identity(self) -> dict[str, str]:
        """``{"id", "project"[, "entity"]}``: what ``wandb.init`` needs to continue this run."""
        if self.run is None:
            identity = {"id": str(self._kwargs["id"]), "project": str(self._kwargs["project"])}
            entity = self._kwargs.get("entity")
        else:
            identity = {"id": str(self.run.id), "project": str(self.run.project)}
            entity = getattr(self.run, "entity", None)
        if entity:
            identity["entity"] = str(entity)
        return identity

    def note(self) -> str:
        """How the run was logged, for a summary line (``"offline"`` or ``""``)."""
        return "offline" if self.offline else ""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log at ``step``; steps below the last one logged (or the resumed run's) are dropped, as
        W&B would drop them; several rows at one step (evaluation and training) are merged.
        ``env_step`` is the step itself, not a metric."""
        run = self._start()
        if step < self.min_step:
            return
        run.log({k: v for k, v in metrics.items() if k != "env_step"}, step=step)
        self.min_step = step

    def summarize(self, values: Mapping[str, Any]) -> None:
        """Set final values of the run (``run.summary``), e.g. ``final_model_saved`` after training."""
        self._start().summary.update(dict(values))

    def sync(self) -> None:
        """Nothing to do: W&B streams (or writes offline) on its own."""

    def close(self, success: bool = True) -> None:
        if self.run is None:  # nothing was logged: no W&B run was started
            return
        if self.offline:
            logger.warning("comlrl: W&B run %s was logged offline; upload it with `wandb sync %s`.", self.run.id,
                           " ".join(str(p) for p in offline_folders(Path(self.run.dir).parent, self.run.id)))
        if success:
            self.run.finish()
        else:  # marks the run failed
            self.run.finish(exit_code=1)


def offline_folders(run_dir: Path, run_id: str) -> list[Path]:
    """Every offline folder of run ``run_id`` beside ``run_dir`` (one per resumed part), oldest
    first: ``wandb sync`` uploads them as one run."""
    found = sorted(run_dir.parent.glob(f"offline-run-*-{run_id}*"), key=lambda p: p.name)
    return found or [run_dir]


def _logged_in(wandb: Any) -> bool:
    """wandb's own check for usable credentials (environment, settings file, .netrc), no prompt."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # noqa: BLE001 - any failure to find credentials means: log offline
        return False
