"""Advantages: a completion's return relative to its group. Pure tensor functions.

Groups are given by an explicit integer id per sample, never by position in a flat list, so the
same functions serve aligned groups, uneven groups and data-parallel shards.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "group_mean_std"]


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
        mode: the baseline subtracted from each return:
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
    mean, std = group_mean_std(r, group_ids)
    if mode == "mean":
        adv = r - mean
    elif mode == "raw":
        adv = r.clone()
    elif mode == "max":
        adv = r - _group_max(r, group_ids)
    elif mode == "rloo":
        counts = torch.bincount(group_ids).to(torch.float64)[group_ids]
        # Leave-one-out mean of the others; a group of one has no others, so its advantage is 0.
        adv = torch.where(counts > 1, (r - mean) * counts / (counts - 1).clamp(min=1), torch.zeros_like(r))
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; use 'mean', 'raw', 'max' or 'rloo'")
    if normalize:
        adv = adv / torch.where(std > eps, std, torch.ones_like(std))
    return adv.to(torch.float32)
