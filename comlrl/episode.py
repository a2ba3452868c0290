"""Multi-turn episodes: the rollout tree, the external transition and discounted returns.

Turn 1 has one node per prompt. At a node every agent samples K completions; the node's joint
actions (K aligned, or K**N cross, see :mod:`comlrl.joint`) are scored by the reward function. For
every joint action that is not the last turn and has not ended early, the user's
``external_transition`` turns the joint answer into one next prompt per agent: a child node of the
next turn. So turn t has up to J**(t-1) nodes per prompt, J joint actions per node.

The return of a joint action is its reward plus ``discount`` times the mean return of its child
node's joint actions. A branch that ended early keeps its reward for the turns it skips (an
absorbing state), so finishing early is never worth less than finishing late. A completion's return is that of its joint action
(aligned) or the mean over the joint actions it took part in (cross); its advantage compares it
with the other K completions of its agent at the same node (the node is the group).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .exceptions import TransitionError

__all__ = ["Node", "Turn", "ExternalTransition", "discounted_returns", "tree_size"]


@dataclass
class Node:
    """One state of an episode: what each agent is prompted with."""

    group: int                         # position of the episode's prompt in the micro-batch
    index: int                         # dataset row of the episode
    path: tuple[int, ...]              # joint-action indices from the root ( () at turn 1 )
    prompts: list[Any]                 # [N] this turn's prompt of each agent (text, or chat messages)
    prompt_history: list[list[Any]]    # [N][t] prompts so far on this branch, this one included
    response_history: list[list[str]]  # [N][t-1] completions so far on this branch


@dataclass
class Turn:
    """Everything one turn of a micro-batch produced."""

    nodes: list[Node]
    rollouts: list[Any]                # [N] Rollout, rows node-major: node i -> rows i*K .. i*K+K-1
    rewards: torch.Tensor              # [len(nodes) * J] float64, node-major
    children: list[Optional[int]] = field(default_factory=list)  # per joint action: child node index or None


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


class ExternalTransition:
    """Wraps the user's ``external_transition`` (CoMLRL keyword names) and checks what it returns.

    The function is called once per continuing joint action with the keyword arguments it
    declares among ``prompt`` (the episode's first-turn prompt of agent 0), ``agent_completions``
    (this joint action's N completions), ``num_agents``, ``prompt_history_per_agent``,
    ``response_history_per_agent`` (both ``[N][turns so far]``, this turn included), ``turn`` (1-based)
    and ``batch_item`` (the dataset row). It must return N strings, the agents' next prompts.
    """

    NAMES = ("prompt", "agent_completions", "num_agents", "prompt_history_per_agent",
             "response_history_per_agent", "turn", "batch_item")

    def __init__(self, func: Callable[..., Sequence[str]], num_agents: int):
        if not callable(func):
            raise TransitionError(f"external_transition must be callable, got {type(func).__name__}.")
        self.func, self.num_agents = func, num_agents
        self.name = getattr(func, "__qualname__", repr(func))
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            params = []
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self.keywords = set(self.NAMES)
        else:
            self.keywords = {p.name for p in params if p.name in self.NAMES}
        if "agent_completions" not in self.keywords:
            raise TransitionError(f"external_transition {self.name} must accept agent_completions=... "
                                  f"(and optionally {', '.join(n for n in self.NAMES if n != 'agent_completions')}).")

    def __call__(self, node: Node, completions: list[str], row: dict[str, Any], turn: int) -> list[str]:
        values = {
            "prompt": node.prompt_history[0][0],
            "agent_completions": list(completions),
            "num_agents": self.num_agents,
            "prompt_history_per_agent": [list(h) for h in node.prompt_history],
            "response_history_per_agent": [h + [c] for h, c in zip(node.response_history, completions)],
            "turn": turn,
            "batch_item": row,
        }
        try:
            out = self.func(**{k: v for k, v in values.items() if k in self.keywords})
        except Exception as exc:
            raise TransitionError(f"external_transition {self.name} raised {type(exc).__name__}: {exc}") from exc
        if isinstance(out, str) or not isinstance(out, Sequence) or len(out) != self.num_agents:
            raise TransitionError(f"external_transition {self.name} must return a list of {self.num_agents} next "
                                  f"prompts (one per agent), got {out!r:.120}.")
        bad = [i for i, p in enumerate(out) if not isinstance(p, str) or not p]
        if bad:
            raise TransitionError(f"external_transition {self.name} returned a non-string or empty prompt for agent "
                                  f"{bad[0]}: {out[bad[0]]!r:.80}.")
        return list(out)
