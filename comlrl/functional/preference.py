"""Preference learning math: choosing pairs, the multi-agent DPO loss, the Bradley-Terry reward
loss, replay weights and reward histograms. Pure functions.

Shapes: ``P`` pairs, ``N`` agents, ``J`` candidates of one prompt.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["select_pairs", "select_comparison_pairs", "dpo_logits", "multi_agent_dpo_loss", "bradley_terry_loss",
           "lambda_decay_weights", "reward_histogram", "replay_draws", "PAIR_SELECTIONS"]

PAIR_SELECTIONS = ("reward_gap", "all", "random", "comparator_reward")


def select_pairs(rewards: Sequence[float], mode: str, limit: Optional[int],
                 rng: Optional[np.random.Generator] = None) -> list[tuple[int, int]]:
    """``(winner, loser)`` candidate indices of one prompt: every pair with different rewards,
    winner the higher (ties never form a pair).

    ``"reward_gap"``: largest gap first (stable: earlier winner, then earlier loser, on equal gaps);
    ``"all"``: by (winner, loser) index, never truncated; ``"random"``: shuffled by ``rng``.
    Then the first ``limit`` (None: all).
    """
    pairs = [(i, j) for i in range(len(rewards)) for j in range(len(rewards)) if rewards[i] > rewards[j]]
    if mode == "reward_gap":
        pairs.sort(key=lambda p: -(rewards[p[0]] - rewards[p[1]]))
    elif mode == "random":
        if rng is None:
            raise ValueError("pair_selection 'random' needs an rng")
        pairs = [pairs[k] for k in rng.permutation(len(pairs))]
    elif mode != "all":
        raise ValueError(f"unknown pair_selection {mode!r} for pairs within a candidate set")
    return pairs if mode == "all" or limit is None else pairs[:limit]


def select_comparison_pairs(current: Sequence[float], comparator: Sequence[float], mode: str, limit: Optional[int],
                            rng: Optional[np.random.Generator] = None) -> list[tuple[str, int]]:
    """Pairs of a current-policy candidate against the comparator's candidate of the same index.

    Returns ``(winner_side, k)``: ``"current"`` when current candidate k beat comparator candidate k,
    ``"comparator"`` otherwise; ties form no pair. Order: ``"reward_gap"`` largest gap first,
    ``"comparator_reward"`` highest comparator reward first (then gap), ``"all"`` by k (never
    truncated), ``"random"`` shuffled by ``rng``; then the first ``limit``.
    """
    found = []
    for k in range(min(len(current), len(comparator))):
        gap = current[k] - comparator[k]
        if gap != 0:
            found.append((abs(gap), comparator[k], k, "current" if gap > 0 else "comparator"))
    if mode == "reward_gap":
        found.sort(key=lambda f: -f[0])
    elif mode == "comparator_reward":
        found.sort(key=lambda f: (-f[1], -f[0]))
    elif mode == "random":
        if rng is None:
            raise ValueError("pair_selection 'random' needs an rng")
        found = [found[i] for i in rng.permutation(len(found))]
    elif mode != "all":
        raise ValueError(f"unknown pair_selection {mode!r}")
    if mode != "all" and limit is not None:
        found = found[:limit]
    return [(side, k) for _, _, k, side in found]


def dpo_logits(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float) -> torch.Tensor:
    """``beta * ((chosen - rejected) - (ref_chosen - ref_rejected))``, each ``[P]`` sequence
    log-probabilities (the reference terms without gradient): an agent's implicit-reward margin."""
    return beta * ((chosen - rejected) - (ref_chosen - ref_rejected).detach().to(chosen.dtype))


def multi_agent_dpo_loss(own: torch.Tensor, partners: torch.Tensor, denominator: Optional[float] = None
                         ) -> torch.Tensor:
    """The DPO loss of one agent when the preference is over joint answers.

    The joint answer's implicit-reward margin is the sum of the agents' margins
    (:func:`dpo_logits`); each agent's loss is ``-log sigmoid(own + partners)`` with the partners'
    margins held constant, so its gradient moves only its own log-probabilities.

    Args:
        own: ``[P]`` this agent's margins (with gradient).
        partners: ``[P]`` the other agents' margins summed (no gradient).
        denominator: divide the sum by this (default ``P``): the pair count of the whole step when
            its pairs are split over processes.
    Returns:
        Scalar loss.
    """
    terms = -torch.nn.functional.logsigmoid(own + partners.detach().to(own.dtype))
    return terms.sum() / (denominator if denominator is not None else max(len(terms), 1))


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, denominator: Optional[float] = None
                       ) -> torch.Tensor:
    """``mean(-log sigmoid(r_chosen - r_rejected))`` of ``[P]`` reward-model scores (the sum over
    ``denominator`` pairs when given)."""
    terms = -torch.nn.functional.logsigmoid(chosen - rejected)
    return terms.sum() / (denominator if denominator is not None else max(len(terms), 1))


def lambda_decay_weights(count: int, lam: float) -> list[float]:
    """Sampling weights of ``count`` replay shards, oldest first: the newest gets ``1 - lam``, each
    older one ``lam`` times the next newer one's, normalised (``lam = 1``: uniform; ``0``: only
    the newest)."""
    if count < 1:
        return []
    if lam >= 1.0:
        return [1.0 / count] * count
    raw = [(1.0 - lam) * lam ** age for age in range(count)]  # newest first
    total = sum(raw)
    return [w / total for w in reversed(raw)]


def reward_histogram(values: Sequence[float], low: float, high: float, bins: int = 16
                     ) -> tuple[list[int], list[float]]:
    """Counts of ``values`` in ``bins`` equal bins over ``[low, high]`` (values outside are clipped
    to the range; non-finite ones dropped) and the ``bins + 1`` edges."""
    edges = np.linspace(low, high, bins + 1)
    finite = np.asarray([v for v in values if np.isfinite(v)], dtype=np.float64)
    counts, _ = np.histogram(np.clip(finite, low, high), bins=edges)
    return [int(c) for c in counts], [float(e) for e in edges]


def replay_draws(shard_sizes: Sequence[int], weights: Sequence[float], size: int, rng: np.random.Generator
                 ) -> list[tuple[int, int]]:
    """``size`` replayed pairs ``(shard, index)``: each draw picks a shard by ``weights``; a shard's
    pairs are drawn without replacement in a shuffled order, reshuffled when exhausted (so a shard
    asked for more pairs than it has repeats each before any twice). Empty shards are never picked."""
    live = [s for s, n in enumerate(shard_sizes) if n > 0]
    if not live or size <= 0:
        return []
    w = np.asarray([weights[s] for s in live], dtype=np.float64)
    w = w / w.sum() if w.sum() > 0 else np.full(len(live), 1.0 / len(live))
    picks = rng.choice(len(live), size=size, p=w)
    queues: dict[int, list[int]] = {}
    out = []
    for pick in picks.tolist():
        shard = live[pick]
        queue = queues.setdefault(shard, [])
        if not queue:
            queue.extend(rng.permutation(shard_sizes[shard]).tolist())
        out.append((shard, queue.pop(0)))
    return out
