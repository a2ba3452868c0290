"""W&B helpers (CoMLRL's names); comlrl's W&B tracker is :mod:`comlrl.tracking.wandb`."""

from ..tracking.wandb import verbose_from_wandb_config, wandb_init_kwargs

__all__ = ["wandb_init_kwargs", "verbose_from_wandb_config"]
