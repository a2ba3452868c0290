"""Advantages: a completion's return relative to its group. Pure tensor functions.

Groups are given by an explicit integer id per sample, never by position in a flat list, so the
same functions serve aligned groups, uneven groups and data-parallel shards.
"""

from __future__ import annotations

from typing import Callable

import torch

from .registry import Registry

__all__ = ["group_advantages", "group_mean_std", "ADVANTAGE_ESTIMATORS", "register_advantage", "AdvantageEstimator"]

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(returns, group_ids) -> advantages``: float64 ``[N]`` returns and int64 ``[N]`` group ids in,
float64 ``[N]`` advantages out (before any std normalisation, which :func:`group_advantages` applies)."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


def group_mean_std(values: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and std of the sample's group.

    Args:
        values: ``[N]`` float returns.
        group_ids: ``[N]`` int64 group index in ``[0, G)``; every group must have >= 1 sample.
        unbiased: divide the squared deviations by ``n - 1`` instead of ``n`` (population std).
    Returns:
        ``(mean, std)``, each ``[N]``: the statistics of the group each sample belongs to. The std of
        a group of one sample is 0.
    """
    values = values.to(torch.float64)
    num_groups = int(group_ids.max().item()) + 1
    counts = torch.bincount(group_ids, minlength=num_groups).to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, group_ids, values)
    mean = (sums / counts)[group_ids]
    sq = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_ids, (values - mean) ** 2
    )
    var = sq / ((counts - 1).clamp(min=1) if unbiased else counts)
    return mean, var.sqrt()[group_ids]


def _group_max(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    num_groups = int(group_ids.max().item()) + 1
    init = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    return init.scatter_reduce(0, group_ids, values, reduce="amax")[group_ids]


# The baselines of the REINFORCE family, one function each (``advantage_mode`` names them).

@register_advantage("mean")
def mean_baseline(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The return less its group's mean (MAGRPO / GRPO)."""
    return returns - group_mean_std(returns, group_ids)[0]


@register_advantage("raw")
def no_baseline(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The return itself (plain REINFORCE)."""
    return returns.clone()


@register_advantage("max")
def max_baseline(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The return less its group's best (ReMax-style; advantages are <= 0)."""
    return returns - _group_max(returns, group_ids)


@register_advantage("rloo")
def leave_one_out_baseline(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The return less the mean of the group's *other* samples, ``K/(K-1) * (r - mean)`` for a
    group of K; a group of one has no others, so its advantage is 0."""
    mean = group_mean_std(returns, group_ids)[0]
    counts = torch.bincount(group_ids).to(torch.float64)[group_ids]
    return torch.where(counts > 1, (returns - mean) * counts / (counts - 1).clamp(min=1), torch.zeros_like(returns))


def group_advantages(
    returns: torch.Tensor,
    group_ids: torch.Tensor,
    mode: str = "mean",
    normalize: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of every sample against its group.

    Args:
        returns: ``[N]`` returns (float).
        group_ids: ``[N]`` int64 group of each sample (samples of one prompt share an id).
        mode: the registered estimator (:data:`ADVANTAGE_ESTIMATORS`) that gives the advantage
            before normalisation; comlrl registers these baselines subtracted from each return:
            ``"mean"``: group mean (MAGRPO / GRPO);
            ``"raw"``: none (plain REINFORCE);
            ``"max"``: group max (ReMax-style; advantages are <= 0);
            ``"rloo"``: mean of the *other* samples of the group (leave-one-out), which equals
            ``K/(K-1) * (r - mean)`` for a group of K.
        normalize: divide by the std (population) of the group's returns, where it exceeds
            ``eps``; a group whose returns are all equal is left unscaled (its mean-based
            advantages are 0 anyway, and a raw or max baseline keeps its value instead of
            being blown up by a zero std).
        eps: the smallest std that rescales a group.
    Returns:
        ``[N]`` float32 advantages, on ``returns.device``.
    """
    if returns.shape != group_ids.shape or returns.dim() != 1:
        raise ValueError(f"returns {tuple(returns.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    r = returns.to(torch.float64)
    adv = ADVANTAGE_ESTIMATORS.get(mode)(r, group_ids)
    if normalize:
        std = group_mean_std(r, group_ids)[1]
        adv = adv / torch.where(std > eps, std, torch.ones_like(std))
    return adv.to(torch.float32)
