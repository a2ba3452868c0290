"""Returns on the rollout tree of multi-turn episodes. Pure tensor functions.

Turn 1 has one node per prompt; each node has J joint actions (K aligned, K**N cross). A joint
action that continues has a child node at the next turn. The return of a joint action is its
reward plus ``discount`` times the mean return of its child node's joint actions; a branch that
ended early is an absorbing state that keeps its reward for the turns it skips.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["tree_size", "discounted_returns"]


def tree_size(num_turns: int, joint_per_node: int) -> tuple[int, int]:
    """``(nodes, joint actions)`` per prompt over all turns of a full tree."""
    nodes = sum(joint_per_node ** t for t in range(num_turns))
    return nodes, nodes * joint_per_node


def discounted_returns(rewards: Sequence[torch.Tensor], children: Sequence[Sequence[Optional[int]]],
                       joint_per_node: int, discount: float, num_turns: Optional[int] = None) -> list[torch.Tensor]:
    """Return of every joint action of every turn.

    Args:
        rewards: per turn ``[nodes_t * J]`` rewards, node-major.
        children: per turn, per joint action, the index of its child node in the next turn (None
            if the branch ended: last turn or early termination).
        discount: gamma; 1.0 = undiscounted.
        num_turns: the episode length T (default: ``len(rewards)``).
    Returns:
        per turn ``[nodes_t * J]`` float64 returns. A continuing joint action gets
        ``G = r + discount * mean(G of the child node's J joint actions)``. A branch that ended early
        at turn t (0-based) is an absorbing state that keeps its reward for the turns it skips:
        ``G = r * (1 + discount + ... + discount**(T-1-t))``, so solving a task early never
        returns less than solving it late.
    """
    turns_total = len(rewards) if num_turns is None else num_turns
    returns: list[torch.Tensor] = [torch.empty(0)] * len(rewards)
    for t in reversed(range(len(rewards))):
        r = rewards[t].to(torch.float64)
        horizon = sum(discount ** i for i in range(turns_total - t))  # r counted for the skipped turns too
        g = r * horizon
        if t + 1 < len(rewards) and len(returns[t + 1]):
            child_means = returns[t + 1].reshape(-1, joint_per_node).mean(dim=1)
            for j, child in enumerate(children[t]):
                if child is not None:
                    g[j] = r[j] + discount * child_means[child]
        returns[t] = g
    return returns
