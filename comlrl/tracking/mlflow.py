"""MLflow: one MLflow run per comlrl run, continued on resume, every step of every metric once.

The tracking server comes from the config (``mlflow_tracking_uri``) or the standard
``MLFLOW_TRACKING_URI`` (credentials only through MLflow's own variables, e.g.
``MLFLOW_TRACKING_TOKEN``); the experiment from ``mlflow_experiment_name``,
``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``, else ``"comlrl"``. A checkpoint saves only
the MLflow run's ``run_id`` and ``experiment_id``, plain id strings: it can never choose the
server metrics (and your token) are sent to.

Each step once: MLflow's metric history is append-only (no call removes or replaces a logged
value). Continuing a run, the tracker reads back the run's history from the checkpoint's step on
and does not send a ``(metric, step)`` the run already holds: the interrupted run's values stand
where the work was redone (identical on a bit-exact resume; a warning names any that differ), and
every later step is logged once.

Needs the ``mlflow`` package: ``pip install -e ".[mlflow]"`` in the checkout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from .._redact import redact
from ..exceptions import CheckpointError, ConfigError
from .steps import StepFilter

__all__ = ["MlflowTracker", "check_mlflow_identity", "check_tracking_uri", "RUN_ID_TAG", "DEFAULT_EXPERIMENT"]

logger = logging.getLogger("comlrl")

RUN_ID_TAG = "comlrl.run_id"  # the comlrl run an MLflow run belongs to
DEFAULT_EXPERIMENT = "comlrl"
IDENTITY_KEYS = ("run_id", "experiment_id")
_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_KEY_CHAR = re.compile(r"[^/\w.\- ]")  # what MLflow refuses in a metric or param name (colons too, on Windows)
# MLflow's limits per log_batch call, and the longest param value of MLflow >= 2.
_MAX_METRICS, _MAX_PARAMS, _MAX_PARAM_VALUE = 1000, 100, 6000


def check_tracking_uri(name: str, value: Any) -> Optional[str]:
    """A config field check: None, or a tracking URI without credentials in it (the config is saved
    in every checkpoint and recorded by the trackers)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be None or a non-empty tracking URI string, got {value!r}.")
    if urlsplit(value).password is not None:
        raise ConfigError(f"{name} holds credentials; the config is saved in every checkpoint. Put them in "
                          "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead.")
    return value


def check_mlflow_identity(identity: Any, where: str) -> Optional[dict[str, str]]:
    """A saved MLflow identity: None, or ``{"run_id", "experiment_id"}`` of plain id strings.

    Anything else (another key such as a tracking URI, a non-string, odd characters) raises
    :class:`CheckpointError` naming ``where``.
    """
    if identity is None:
        return None
    if not isinstance(identity, Mapping):
        raise CheckpointError(f"{where}: the MLflow identity must be an object or null, got {type(identity).__name__}.")
    if set(identity) != set(IDENTITY_KEYS):
        raise CheckpointError(f"{where}: the MLflow identity must hold exactly {list(IDENTITY_KEYS)}, found "
                              f"{sorted(identity)} (a checkpoint must not steer MLflow).")
    for key, value in identity.items():
        if not isinstance(value, str) or not _ID.match(value):
            raise CheckpointError(f"{where}: MLflow identity field {key!r} must be a plain id (letters, digits, "
                                  f"'_', '-'), got {value!r:.60}.")
    return {k: identity[k] for k in IDENTITY_KEYS}


def _key(key: str) -> str:
    """``key`` as a name MLflow accepts (other characters become ``_``)."""
    return _KEY_CHAR.sub("_", str(key))[:250]


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:_MAX_PARAM_VALUE]


class MlflowTracker:
    """Logs rows to one MLflow run through :class:`mlflow.tracking.MlflowClient` (no global active
    run: a user's own ``mlflow.start_run`` is left alone).

    Args:
        tracking_uri: None = ``MLFLOW_TRACKING_URI``, else MLflow's default store.
        experiment_name: None = ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``, else ``"comlrl"``.
        run_name: the name of a new MLflow run (None: MLflow picks one).
        run_config: hyper-parameters, logged as the params of a new run.
        comlrl_run_id: saved as the run's ``comlrl.run_id`` tag.
        identity: a saved ``{"run_id", "experiment_id"}`` to continue, or None.
        resume_step: None for a fresh run; continuing, the checkpoint's ``env_step``.
    """

    name = "mlflow"

    def __init__(self, tracking_uri: Optional[str] = None, experiment_name: Optional[str] = None,
                 run_name: Optional[str] = None, run_config: Optional[Mapping[str, Any]] = None,
                 comlrl_run_id: Optional[str] = None, identity: Optional[Mapping[str, str]] = None,
                 resume_step: Optional[int] = None):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.comlrl_run_id = comlrl_run_id
        run = self._continued(identity) if identity and resume_step is not None else None
        present: dict[str, dict[int, float]] = {}
        if run is None:
            run = self._create(experiment_name, run_name, dict(run_config or {}))
        else:
            present = self._history(run, resume_step)
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.filter = StepFilter(present, "MLflow")
        self._renamed_said = False

    # --- opening --------------------------------------------------------------------------------
    def _continued(self, identity: Mapping[str, str]) -> Any:
        """The saved run, or None (with a warning) when this server has no usable run of that id."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(identity["run_id"])
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # an unreachable server is an error, not a new run
                raise
            logger.warning("comlrl: the checkpoint's MLflow run %s is not on this tracking server (%s); starting a "
                           "new MLflow run.", identity["run_id"], str(exc).splitlines()[0][:200])
            return None
        owner = run.data.tags.get(RUN_ID_TAG)
        if run.info.lifecycle_stage != "active" or (owner is not None and owner != self.comlrl_run_id):
            logger.warning("comlrl: the checkpoint's MLflow run %s is %s; starting a new MLflow run.",
                           identity["run_id"], "deleted" if run.info.lifecycle_stage != "active"
                           else f"another comlrl run's ({owner})")
            return None
        return run

    def _history(self, run: Any, since: int) -> dict[str, dict[int, float]]:
        """What the run holds from step ``since`` on: ``{key: {step: value}}``."""
        present: dict[str, dict[int, float]] = {}
        for key in run.data.metrics:
            later = {m.step: m.value for m in self.client.get_metric_history(run.info.run_id, key) if m.step >= since}
            if later:
                present[key] = later
        return present

    def _experiment_id(self, name: Optional[str]) -> str:
        if name is None and os.environ.get("MLFLOW_EXPERIMENT_ID") and not os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            from mlflow.exceptions import MlflowException

            try:
                return self.client.create_experiment(name)
            except MlflowException:  # created meanwhile by another process
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise ConfigError(f"MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore) or set "
                              "mlflow_experiment_name to another name.")
        return experiment.experiment_id

    def _create(self, experiment_name: Optional[str], run_name: Optional[str], run_config: dict[str, Any]) -> Any:
        from mlflow.entities import Param

        tags = {RUN_ID_TAG: self.comlrl_run_id} if self.comlrl_run_id else {}
        run = self.client.create_run(self._experiment_id(experiment_name), tags=tags, run_name=run_name)
        params = [Param(_key(k), _param_value(v)) for k, v in sorted(redact(run_config).items())]
        for start in range(0, len(params), _MAX_PARAMS):
            self.client.log_batch(run.info.run_id, params=params[start:start + _MAX_PARAMS], synchronous=True)
        return run

    # --- the Tracker interface --------------------------------------------------------------------
    def log(self, row: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        renamed = {_key(k): v for k, v in row.items()}
        odd = sorted(k for k in row if _key(k) != k)
        if odd and not self._renamed_said:
            self._renamed_said = True
            logger.warning("comlrl: MLflow accepts letters, digits and '_-. /' in metric names; logging %s as %s.",
                           odd, [_key(k) for k in odd])
        metrics = [Metric(key, value, stamp, step) for key, value in self.filter.new_values(renamed, step).items()]
        for start in range(0, len(metrics), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + _MAX_METRICS], synchronous=True)

    def sync(self) -> None:
        """Nothing to do: every row was sent synchronously."""

    def close(self, success: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if success else "FAILED")

    def identity(self) -> dict[str, str]:
        """``{"run_id", "experiment_id"}``: what a resumed run continues."""
        return {"run_id": str(self.run_id), "experiment_id": str(self.experiment_id)}
