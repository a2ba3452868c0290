"""Actor-critic math: TD targets over the episode tree, normalised advantages, the (clipped) value
loss. Pure tensor functions.

Shapes: ``R_t`` rows of turn t (node-major, ``K`` rows per node), ``G`` normalisation groups.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["td_targets", "group_moments", "normalize_advantages", "value_errors"]


def td_targets(rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               children: Sequence[Sequence[Optional[int]]], k: int, discount: float,
               num_turns: Optional[int] = None) -> list[torch.Tensor]:
    """One-step TD targets ``r_t + discount * V(next state)`` of every row of an episode tree.

    The next state of row r of turn t is the child node ``children[t][r]`` of turn t+1; its value
    is the mean of that node's K rows' values (for a state value all K are equal; for an
    action value with K = 1 it is the one action taken). A row without a child is terminal. At
    the last turn its target is its reward; a branch that ended early (turn t of T) is the
    absorbing state of :func:`comlrl.functional.returns.discounted_returns`, which keeps its reward
    for the turns it skips: ``r * (1 + discount + ... + discount**(T-1-t))``.

    Args:
        rewards: per turn, ``[R_t]`` the rows' rewards (after any KL penalty).
        values: per turn, ``[R_t]`` the critic's values of the rows, computed before any update.
        children: per turn, ``R_t`` child node indices or None.
        k: rows per node.
        num_turns: the episode length T (default: ``len(rewards)``).
    Returns:
        Per turn, ``[R_t]`` float64 targets (no gradient).
    """
    total = len(rewards) if num_turns is None else num_turns
    out = []
    for t, (r, child_of) in enumerate(zip(rewards, children)):
        horizon = sum(discount ** i for i in range(total - t))
        target = r.detach().to(torch.float64) * horizon
        if len(child_of) != len(target):
            raise ValueError(f"turn {t}: {len(child_of)} children for {len(target)} rows")
        rows = [i for i, c in enumerate(child_of) if c is not None]
        if rows:
            nxt = values[t + 1].detach().to(torch.float64).view(-1, k).mean(dim=1)
            index = torch.tensor([child_of[i] for i in rows], dtype=torch.long)
            at = torch.tensor(rows, dtype=torch.long)
            target[at] = r.detach().to(torch.float64)[at] + discount * nxt[index]
        out.append(target)
    return out


def group_moments(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[G, 3]`` float64 (count, sum, sum of squares) of ``values [N]`` per group id ``groups [N]``:
    sums that add up across processes."""
    v = values.detach().to(torch.float64)
    out = torch.zeros(num_groups, 3, dtype=torch.float64)
    out[:, 0].index_add_(0, groups, torch.ones_like(v))
    out[:, 1].index_add_(0, groups, v)
    out[:, 2].index_add_(0, groups, v * v)
    return out


def normalize_advantages(advantages: torch.Tensor, groups: torch.Tensor, moments: Optional[torch.Tensor] = None,
                         eps: float = 1e-6) -> torch.Tensor:
    """``(A - mean) / max(std, eps)`` within each group (population std), leaving groups of a single
    sample as they are.

    Args:
        advantages: ``[N]``.
        groups: ``[N]`` int64 group ids.
        moments: ``[G, 3]`` from :func:`group_moments` (summed over processes when the group
            spans several); None: those of ``advantages`` itself.
    Returns:
        ``[N]`` float32.
    """
    a = advantages.detach().to(torch.float64)
    if moments is None:
        moments = group_moments(a, groups, int(groups.max()) + 1 if len(groups) else 0)
    count = moments[groups, 0]
    mean = moments[groups, 1] / count.clamp(min=1)
    var = (moments[groups, 2] / count.clamp(min=1) - mean * mean).clamp(min=0)
    normalized = (a - mean) / var.sqrt().clamp(min=eps)
    return torch.where(count > 1, normalized, a).to(torch.float32)


def value_errors(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor,
                 clip_range: Optional[float]) -> torch.Tensor:
    """Per-sample squared error of a critic, PPO-clipped around the values it had at rollout.

    With ``clip_range`` c: ``max((V - y)^2, (V_old + clamp(V - V_old, -c, c) - y)^2)``, so one update
    cannot move a value further than c from its rollout-time value for free. None: ``(V - y)^2``.

    Args:
        values: ``[N]`` current values (with grad).
        old_values, targets: ``[N]`` (no grad).
    Returns:
        ``[N]`` in ``values``' dtype.
    """
    targets = targets.to(values.dtype)
    errors = (values - targets) ** 2
    if clip_range is None:
        return errors
    old = old_values.to(values.dtype)
    clipped = old + torch.clamp(values - old, -clip_range, clip_range)
    return torch.maximum(errors, (clipped - targets) ** 2)
