"""Completion masks, the policy-gradient loss and KL estimates. Pure tensor functions.

Shapes: ``R`` rows (completions), ``T`` completion length (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .registry import Registry

__all__ = ["completion_mask", "policy_gradient_loss", "clipped_policy_loss", "token_sum", "loss_denominator",
           "aggregate_tokens", "sequence_kl", "sequence_ratio", "LOSS_TYPES", "POLICY_LOSSES", "register_policy_loss",
           "PolicyLossSpec", "PolicyLossFn"]

LOSS_TYPES = ("sequence", "grpo", "token_mean", "dr_grpo")

def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Iterable[int]) -> torch.Tensor:
    """Which completion tokens are scored: everything up to and including the first EOS.

    Args:
        completion_ids: ``[R, T]`` sampled token ids (anything after the first EOS is padding).
        eos_token_ids: ids that end a completion.
    Returns:
        ``[R, T]`` bool mask; a row without EOS (cut by max_new_tokens) is scored in full.
    """
    eos = torch.tensor(sorted(set(eos_token_ids)), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos).to(torch.int64)
    # Number of EOS tokens strictly before each position: 0 means "not past the first EOS".
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return eos_before == 0


def policy_gradient_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "sequence",
    max_new_tokens: int | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """REINFORCE-with-baseline loss of one on-policy update (GRPO's loss at ratio 1).

    Args:
        log_probs: ``[R, T]`` log-probs of the sampled tokens (with grad).
        advantages: ``[R]`` one advantage per completion (no grad).
        mask: ``[R, T]`` bool, tokens that are scored (see :func:`completion_mask`).
        loss_type: how tokens and completions are weighed (see :func:`token_sum`).
        denominator: divide by this instead of this batch's own :func:`loss_denominator`: the
            denominator of the whole optimizer step, when its rows are split over micro-batches
            or processes, so that the pieces' losses add up to the loss of the whole step.
    Returns:
        Scalar loss; its gradient is ``-E[A * grad log pi]`` under the chosen normalisation.
    """
    per_token = -advantages.to(log_probs.dtype).unsqueeze(1) * log_probs
    return aggregate_tokens(per_token, mask, loss_type, max_new_tokens, denominator)


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None,
    loss_type: str = "sequence",
    max_new_tokens: int | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate with token-level ratios (GRPO's loss as TRL and verl compute it).

    Per scored token ``t`` of a completion with advantage ``A``: ``r_t = exp(logp_t - old_t)`` and
    the loss ``-min(r_t * A, clip(r_t, 1 - eps, 1 + eps) * A)``; aggregated over tokens and rows as
    :func:`policy_gradient_loss` does for ``loss_type``. ``clip_eps=None`` keeps the unclipped ratio.
    At ``log_probs == old_log_probs`` (the first update after sampling) every ratio is exactly 1,
    nothing is clipped, and the gradient is exactly :func:`policy_gradient_loss`'s.

    Args:
        log_probs: ``[R, T]`` log-probs of the sampled tokens under the policy being updated (grad).
        old_log_probs: ``[R, T]`` the same under the policy that sampled them (no grad).
        advantages: ``[R]`` one advantage per completion (no grad).
        mask: ``[R, T]`` bool, the scored tokens.
        clip_eps: the clip range ``eps`` (> 0), or None.
    Returns:
        ``(loss, clipped)``: the scalar loss, and ``[R, T]`` bool, which scored tokens the clip
        held back (the min took the clipped term and it differs from the unclipped one).
    """
    ratio = torch.exp(log_probs - old_log_probs.detach().to(log_probs.dtype))
    adv = advantages.to(log_probs.dtype).unsqueeze(1)
    unclipped = ratio * adv
    if clip_eps is None:
        surrogate, clipped = unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        bounded = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        surrogate = torch.minimum(unclipped, bounded)
        clipped = (bounded < unclipped) & mask.bool()
    return aggregate_tokens(-surrogate, mask, loss_type, max_new_tokens, denominator), clipped


def sequence_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[R]`` float64 probability ratio of whole completions, ``exp(sum_t (logp_t - old_t))`` over
    the scored tokens (no gradient): how much more likely the updated policy makes each sample."""
    delta = torch.where(mask.bool(), log_probs.detach().double() - old_log_probs.detach().double(),
                        torch.zeros((), dtype=torch.float64, device=log_probs.device))
    return torch.exp(delta.sum(dim=1))


def token_sum(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The numerator of a loss over the scored tokens ``mask`` of ``[R, T]`` per-token values.

    ``"sequence"``: sum of each row's tokens, summed over rows (REINFORCE's sequence log-prob);
    ``"grpo"``: mean of each row's tokens, summed over rows; ``"token_mean"``, ``"dr_grpo"``: the
    sum of all scored tokens. Unscored positions never count (they are selected away, so a NaN or
    inf there cannot leak into the result).
    """
    mask = mask.bool()
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if loss_type in ("sequence", "token_mean", "dr_grpo"):
        return per_token.sum()
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1).to(per_token.dtype)).sum()
    raise ValueError(f"unknown loss_type {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")


def loss_denominator(mask: torch.Tensor, loss_type: str, max_new_tokens: int | None = None) -> float:
    """What :func:`token_sum` is divided by: rows (``sequence``, ``grpo``), scored tokens
    (``token_mean``) or rows x ``max_new_tokens`` (``dr_grpo``)."""
    if loss_type == "token_mean":
        return float(mask.sum())
    if loss_type == "dr_grpo":
        if max_new_tokens is None:
            raise ValueError("loss_type 'dr_grpo' needs max_new_tokens")
        return float(mask.shape[0] * max_new_tokens)
    return float(mask.shape[0])


def aggregate_tokens(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str = "sequence",
                     max_new_tokens: int | None = None, denominator: float | None = None) -> torch.Tensor:
    """:func:`token_sum` / ``denominator`` (default: :func:`loss_denominator` of this batch)."""
    if denominator is None:
        denominator = loss_denominator(mask, loss_type, max_new_tokens)
    return token_sum(per_token, mask, loss_type) / max(denominator, 1.0)


def sequence_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor,
                estimator: str = "k1") -> torch.Tensor:
    """Per-completion estimate of KL(policy || reference) from its sampled tokens.

    ``"k1"``: the sum over scored tokens of ``logp - ref``, the log-ratio of the completion. On samples
    of the policy its mean is the KL, and as a penalty on the return its REINFORCE gradient is the
    KL's gradient (RLHF's KL-in-reward). ``"k3"``: the sum of ``exp(ref - logp) - (ref - logp) - 1``
    (Schulman 2020), never negative and of lower variance, but as a reward its REINFORCE gradient is
    biased (CoMLRL 1.4.3 penalises returns with it).

    Args:
        log_probs, ref_log_probs: ``[R, T]`` the policy's and the reference's log-probs of the
            sampled tokens.
        mask: ``[R, T]`` bool, the scored tokens.
    Returns:
        ``[R]`` float64, no gradient.
    """
    mask = mask.bool()
    delta = torch.where(mask, ref_log_probs.detach().double() - log_probs.detach().double(),
                        torch.zeros((), dtype=torch.float64, device=log_probs.device))
    if estimator == "k1":
        return -delta.sum(dim=1)
    if estimator == "k3":
        return torch.where(mask, torch.exp(delta) - delta - 1.0, torch.zeros_like(delta)).sum(dim=1)
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")


# --- policy losses by name ------------------------------------------------------------------------

PolicyLossFn = Callable[..., "tuple[torch.Tensor, Optional[torch.Tensor]]"]
"""``fn(log_probs, old_log_probs, advantages, mask, spec, denominator) -> (loss, clipped)``:
``[R, T]`` log-probs (grad), the sampling policy's ``[R, T]`` (None unless the loss was registered
with ``ratio=True``), ``[R]`` advantages, the ``[R, T]`` scored tokens, the :class:`PolicyLossSpec`
and the optimizer step's denominator in; the scalar loss and ``[R, T]`` bool, which tokens a clip
held back (None: no clip), out."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str, *, ratio: bool = False, replace: bool = False) -> Callable[[PolicyLossFn],
                                                                                             PolicyLossFn]:
    """Register a policy loss as ``name``; ``ratio=True``: it compares against the sampling
    policy's log-probs (the update phase keeps them for it)."""
    return POLICY_LOSSES.register(name, ratio=ratio, replace=replace)


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which policy loss an update takes, built once (from a config) and handed to every backward.

    ``name``: a registered policy loss (:data:`POLICY_LOSSES`: ``"reinforce"``, the loss at ratio 1;
    ``"clipped"``, PPO's clipped-ratio surrogate); ``loss_type``: how tokens and rows are weighed
    (one of :data:`LOSS_TYPES`); ``max_new_tokens``: ``dr_grpo``'s constant; ``clip_eps``: the clip
    range of ``"clipped"`` (None: unclipped).
    """

    name: str = "reinforce"
    loss_type: str = "sequence"
    max_new_tokens: Optional[int] = None
    clip_eps: Optional[float] = None

    def __post_init__(self) -> None:
        POLICY_LOSSES.get(self.name)  # refused now, naming the registered ones
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        if self.loss_type == "dr_grpo" and self.max_new_tokens is None:
            raise ValueError("loss_type 'dr_grpo' needs max_new_tokens")

    @property
    def uses_old_log_probs(self) -> bool:
        """Whether the loss compares against the sampling policy (registered with ``ratio=True``)."""
        return bool(POLICY_LOSSES.facts(self.name).get("ratio", False))

    def denominator(self, mask: torch.Tensor) -> float:
        """:func:`loss_denominator` of ``mask``'s rows under this spec."""
        return loss_denominator(mask, self.loss_type, self.max_new_tokens)

    def __call__(self, log_probs: torch.Tensor, old_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                 mask: torch.Tensor, denominator: Optional[float] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return POLICY_LOSSES.get(self.name)(log_probs, old_log_probs, advantages, mask, self, denominator)


@register_policy_loss("reinforce")
def _reinforce_loss(log_probs, old_log_probs, advantages, mask, spec: PolicyLossSpec, denominator):
    """:func:`policy_gradient_loss` (the loss at ratio 1)."""
    return policy_gradient_loss(log_probs, advantages, mask, spec.loss_type, spec.max_new_tokens, denominator), None


@register_policy_loss("clipped", ratio=True)
def _clipped_loss(log_probs, old_log_probs, advantages, mask, spec: PolicyLossSpec, denominator):
    """:func:`clipped_policy_loss` against the sampling policy's log-probs."""
    return clipped_policy_loss(log_probs, old_log_probs, advantages, mask, spec.clip_eps, spec.loss_type,
                               spec.max_new_tokens, denominator=denominator)
