"""Dr. GRPO: GRPO done right (Liu et al., "Understanding R1-Zero-Like Training: A Critical
Perspective", arXiv 2503.20783), written on :mod:`comlrl.extend` alone.

GRPO divides each completion's token sum by its own length and each group's advantages by the
group's return std. Both bias the update: the length term favours long wrong answers and short
right ones, the std term overweights prompts that are nearly always (or never) solved. Dr. GRPO
drops both: the advantage is the return less its group's mean, and the loss is the sum over every
scored token of the step divided by one constant, completions x ``max_new_tokens``::

    loss = -sum_{i, t} A_i * log pi(o_{i,t}) / (R * max_new_tokens),   A_i = r_i - mean(group of i)

What this module adds to MAGRPO is one registered policy loss (``"dr_grpo"``) and a config whose
defaults are the paper's and which refuses the two normalisations. Everything else (rollout,
scoring, checkpoints, exact resume, several agents) is MAGRPO's, through the public surface.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..exceptions import ConfigError
from ..extend import (MAGRPOConfig, MAGRPOTrainer, PolicyLossSpec, check_bool, check_choice, config_class,
                      register_policy_loss, setting)

__all__ = ["DrGRPOConfig", "DrGRPOTrainer", "dr_grpo_loss"]


@register_policy_loss("dr_grpo")
def dr_grpo_loss(log_probs: torch.Tensor, old_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                 mask: torch.Tensor, spec: PolicyLossSpec, denominator: Optional[float]
                 ) -> tuple[torch.Tensor, None]:
    """``-sum over scored tokens of A * log pi`` divided by ``denominator``, the optimizer step's
    completions x ``max_new_tokens`` on every process (``spec``'s for these rows when None).

    Args:
        log_probs: ``[R, T]`` log-probs of the sampled tokens (with grad).
        old_log_probs: unused (an on-policy loss, registered without ``ratio``).
        advantages: ``[R]`` one advantage per completion.
        mask: ``[R, T]`` bool, the scored tokens.
    """
    per_token = -advantages.to(log_probs.dtype).unsqueeze(1) * log_probs
    total = torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum()
    return total / max(spec.denominator(mask) if denominator is None else denominator, 1.0), None


@config_class
class DrGRPOConfig(MAGRPOConfig):
    """MAGRPO's settings with Dr. GRPO's loss and advantages (no length, no std normalisation)."""

    loss_type: str = setting("dr_grpo", "Dr. GRPO's constant normaliser: the step's token sum / (completions x "
                                        "max_new_tokens); the only choice.", check_choice("dr_grpo"))
    advantage_normalization: bool = setting(False, "Must stay False: Dr. GRPO divides no group's advantages by "
                                                   "its std.", check_bool)
    advantage_mode: str = setting("mean", "Baseline: 'mean' (the group's mean return), Dr. GRPO's.",
                                  check_choice("mean"))

    def validate(self) -> None:
        super().validate()
        if self.advantage_normalization:
            raise ConfigError("DrGRPOConfig: advantage_normalization=True divides each group's advantages by its "
                              "std, the bias Dr. GRPO removes; leave it False (or use MAGRPOConfig).")


class DrGRPOTrainer(MAGRPOTrainer):
    """MAGRPO (GRPO with one agent) trained with Dr. GRPO's unbiased loss.

    Arguments: those of :class:`~comlrl.trainers.reinforce.MAGRPOTrainer`, with a
    :class:`DrGRPOConfig`. With ``ppo_clip_eps`` or ``num_update_epochs > 1`` the update is the
    clipped-ratio surrogate with the same constant normaliser (the paper's PPO form)."""

    config_class = DrGRPOConfig
    algorithm_name = "DrGRPO"

    def policy_loss_spec(self) -> PolicyLossSpec:
        args = self.args
        if not isinstance(args, DrGRPOConfig):
            raise ConfigError(f"DrGRPOTrainer needs a DrGRPOConfig (its loss and advantages), got "
                              f"{type(args).__name__}.")
        name = "clipped" if args.ratio_loss else "dr_grpo"
        return PolicyLossSpec(name, "dr_grpo", args.max_new_tokens, args.ppo_clip_eps)
