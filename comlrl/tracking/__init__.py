"""Where metrics go: ``metrics.jsonl`` always, W&B when a ``wandb_config`` is given."""

from .jsonl import JsonlSink, strict_json
from .wandb import WandbSink, check_identity, check_wandb_config, wandb_init_kwargs

__all__ = ["JsonlSink", "WandbSink", "check_identity", "check_wandb_config", "strict_json", "wandb_init_kwargs"]
