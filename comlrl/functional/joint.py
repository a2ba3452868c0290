"""Joint actions: which completions of the agents are scored together, and each completion's return.

``aligned``: completion k of every agent forms joint action k; K joint actions per prompt group,
and every agent's completion k gets the reward of joint action k.

``cross``: every combination of one completion per agent is a joint action; K**N per group. A
completion's return is the mean reward of the K**(N-1) joint actions it took part in (the others'
completions marginalised out), which is what its group baseline is compared against.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["joint_actions_per_group", "cross_combinations", "cross_returns"]


def joint_actions_per_group(mode: str, num_generations: int, num_agents: int) -> int:
    """How many joint actions one prompt group yields (and the reward function scores)."""
    return num_generations if mode == "aligned" else num_generations ** num_agents


def cross_combinations(num_generations: int, num_agents: int) -> torch.Tensor:
    """``[K**N, N]`` int64: row j holds the completion index each agent contributes to joint action j
    (lexicographic order, the last agent varying fastest)."""
    combos = list(itertools.product(range(num_generations), repeat=num_agents))
    return torch.tensor(combos, dtype=torch.long).reshape(len(combos), num_agents)


def cross_returns(rewards: torch.Tensor, num_generations: int, num_agents: int) -> torch.Tensor:
    """Per-agent completion returns from cross-mode rewards.

    Args:
        rewards: ``[G, K**N]`` reward of every joint action of every group, in the order of
            :func:`cross_combinations`.
    Returns:
        ``[N, G * K]``: for agent a, group g, completion k, the mean reward over the joint actions
        of group g in which agent a played completion k (rows prompt-major, like rollouts).
    """
    groups = rewards.shape[0]
    cube = rewards.reshape((groups,) + (num_generations,) * num_agents)  # [G, K, K, ..., K]
    out = []
    for agent in range(num_agents):
        others = tuple(1 + d for d in range(num_agents) if d != agent)
        out.append(cube.mean(dim=others) if others else cube)  # [G, K]
    return torch.stack(out).reshape(num_agents, groups * num_generations)
