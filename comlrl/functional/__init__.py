"""Pure tensor functions of the training step: advantages, returns, losses, joint actions,
and the log-probabilities of sampled tokens."""

from .._imports import require_torch

require_torch("comlrl.functional")  # before the first torch import: say how to install it

from .advantages import ADVANTAGE_ESTIMATORS, group_advantages, group_mean_std, register_advantage
from .joint import cross_combinations, cross_returns, joint_actions_per_group
from .logprobs import linear_selected_log_probs, selected_log_probs, sequence_log_probs
from .losses import (LOSS_TYPES, POLICY_LOSSES, PolicyLossSpec, aggregate_tokens, clipped_policy_loss, completion_mask,
                     loss_denominator, policy_gradient_loss, register_policy_loss, sequence_kl, sequence_ratio,
                     token_sum)
from .registry import Registry
from .returns import discounted_returns, tree_size

__all__ = ["group_advantages", "group_mean_std", "cross_combinations", "cross_returns", "joint_actions_per_group",
           "linear_selected_log_probs", "selected_log_probs", "sequence_log_probs", "LOSS_TYPES", "aggregate_tokens",
           "completion_mask", "loss_denominator", "policy_gradient_loss", "clipped_policy_loss", "sequence_kl",
           "sequence_ratio", "token_sum", "ADVANTAGE_ESTIMATORS", "register_advantage", "POLICY_LOSSES",
           "register_policy_loss", "PolicyLossSpec", "Registry",
           "discounted_returns", "tree_size"]
