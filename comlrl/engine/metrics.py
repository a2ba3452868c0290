"""Metrics of played episodes, shared by training and evaluation, and merged across processes."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import distributed as dist
from .episode import Turn

__all__ = ["EpisodeRecord", "record_turns", "merge_records", "episode_metrics"]

# One process's episodes, reduced to what metrics need (picklable, small):
# {"rewards": [turn][tensor], "returns": [turn][tensor], "lengths": [turn][agent][tensor]}
EpisodeRecord = dict[str, Any]


def record_turns(turns: Sequence[Turn], returns: Sequence[torch.Tensor]) -> EpisodeRecord:
    """What the metrics need of a batch's turns and their joint-action returns."""
    return {"rewards": [t.rewards.cpu() for t in turns], "returns": [r.cpu() for r in returns],
            "lengths": [[ro.lengths.float().cpu() for ro in t.rollouts] for t in turns]}


def merge_records(records: Sequence[EpisodeRecord], num_turns: int, num_agents: int,
                  ctx: dist.DistContext) -> EpisodeRecord:
    """Every process's records, in the order one process would have produced them."""
    merged: EpisodeRecord = {"rewards": [[] for _ in range(num_turns)], "returns": [[] for _ in range(num_turns)],
                             "lengths": [[[] for _ in range(num_agents)] for _ in range(num_turns)]}
    for rank_records in dist.gather_objects(list(records), ctx):
        for record in rank_records:
            for t, (r, g) in enumerate(zip(record["rewards"], record["returns"])):
                merged["rewards"][t].append(r)
                merged["returns"][t].append(g)
                for a in range(num_agents):
                    merged["lengths"][t][a].append(record["lengths"][t][a])
    return merged


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(parts)) if parts else torch.zeros(0, dtype=torch.float64)


def episode_metrics(merged: EpisodeRecord, prefix: str, turn_prefix: str) -> dict[str, float]:
    """Rewards, returns and completion lengths of merged episodes.

    Keys: ``{prefix}/reward_mean|std|min|max``, ``{prefix}/return_mean`` (first-turn returns),
    ``{turn_prefix}turn_{t}/reward_mean`` and ``{turn_prefix}turn_{t}/expected_return`` (CoMLRL's
    names: the mean reward and return of turn t's joint actions), and
    ``{prefix}/agent_{a}/completion_length`` (mean tokens).
    """
    rewards = _cat([r for turn in merged["rewards"] for r in turn])
    metrics: dict[str, float] = {}
    if len(rewards):
        metrics.update({f"{prefix}/reward_mean": float(rewards.mean()),
                        f"{prefix}/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                        f"{prefix}/reward_min": float(rewards.min()), f"{prefix}/reward_max": float(rewards.max()),
                        f"{prefix}/return_mean": float(_cat(merged["returns"][0]).mean())})
    for t, (turn_rewards, turn_returns) in enumerate(zip(merged["rewards"], merged["returns"])):
        if turn_rewards:
            metrics[f"{turn_prefix}turn_{t + 1}/reward_mean"] = float(_cat(turn_rewards).mean())
            metrics[f"{turn_prefix}turn_{t + 1}/expected_return"] = float(_cat(turn_returns).mean())
    num_agents = len(merged["lengths"][0]) if merged["lengths"] else 0
    for a in range(num_agents):
        lengths = _cat([x for turn in merged["lengths"] for x in turn[a]])
        if len(lengths):
            metrics[f"{prefix}/agent_{a}/completion_length"] = float(lengths.mean())
            metrics[f"{prefix}/agent_{a}/completion_length_max"] = float(lengths.max())
    return metrics
