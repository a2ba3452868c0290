"""Where metrics go (``report_to``): ``metrics.jsonl``, W&B, TensorBoard, MLflow, each a
:class:`Tracker`. By default ``metrics.jsonl`` always and W&B when a ``wandb_config`` is given."""

from .jsonl import JsonlSink, strict_json
from .steps import StepFilter
from .trackers import (TRACKERS, Tracker, TrackerContext, active_trackers, check_report_to, check_tracker_identities,
                       open_trackers)
from .wandb import WandbSink, check_identity, check_wandb_config, wandb_init_kwargs

__all__ = ["JsonlSink", "WandbSink", "Tracker", "TrackerContext", "TRACKERS", "StepFilter", "active_trackers",
           "check_identity", "check_report_to", "check_tracker_identities", "check_wandb_config", "open_trackers",
           "strict_json", "wandb_init_kwargs"]
