"""Episodes: the rollout tree of a batch of prompts, played turn by turn.

Turn 1 has one node per prompt. At a node every agent samples K completions; the node's joint
actions (K aligned, K**N cross, see :mod:`comlrl.functional.joint`) are scored by the reward
function, node by node. A node whose mean reward is above ``early_termination_threshold``
ends its branch; otherwise, before the last turn, every joint action becomes a child node of the
next turn, prompted with what the user's ``external_transition`` makes of that joint answer.
Returns over the tree are computed by :func:`comlrl.functional.returns.discounted_returns`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..exceptions import TransitionError
from ..rollout import Rollout
from .rewards import user_failure
from .timing import PhaseTimer

__all__ = ["Node", "Turn", "ExternalTransition", "play_episodes"]


@dataclass
class Node:
    """One state of an episode: what each agent is prompted with."""

    group: int                         # position of the episode's prompt in the batch
    index: int                         # dataset row of the episode
    path: tuple[int, ...]              # joint-action indices from the root ( () at turn 1 )
    prompts: list[Any]                 # [N] this turn's prompt of each agent (text, or chat messages)
    prompt_history: list[list[Any]]    # [N][t] prompts so far on this branch, this one included
    response_history: list[list[str]]  # [N][t-1] completions so far on this branch


@dataclass
class Turn:
    """Everything one turn of a batch produced."""

    nodes: list[Node]
    rollouts: list[Rollout]            # [N], rows node-major: node i -> rows i*K .. i*K+K-1
    completions: list[list[str]]       # [N][nodes * J] each agent's completion in every joint action
    rewards: torch.Tensor              # [nodes * J] float64, node-major (the mean over agents of per-agent ones)
    children: list[Optional[int]] = field(default_factory=list)  # per joint action: child node or None
    agent_rewards: Optional[torch.Tensor] = None  # [N, nodes * J] when the reward gave each agent its own


class ExternalTransition:
    """The user's ``external_transition``, called with CoMLRL's keyword arguments.

    It receives, by keyword, those it declares among: ``prompt`` (the task's ``prompt`` field),
    ``agent_completions`` (this joint action's N completions), ``num_agents``,
    ``prompt_history_per_agent`` and ``response_history_per_agent`` (``[N][turns so far]``, this turn
    included), and as comlrl additions, only when named explicitly, ``turn`` (1-based, the turn
    just played) and ``batch_item`` (the dataset row). It returns the N agents' next prompts.
    """

    NAMES = ("prompt", "agent_completions", "num_agents", "prompt_history_per_agent", "response_history_per_agent")
    EXTRA = ("turn", "batch_item")

    def __init__(self, func: Callable[..., Sequence[str]], num_agents: int):
        if not callable(func):
            raise TransitionError(f"external_transition must be callable, got {type(func).__name__}.")
        self.func, self.num_agents = func, num_agents
        self.name = getattr(func, "__qualname__", type(func).__name__)
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # unreadable: pass what CoMLRL passes
            self.keywords = set(self.NAMES)
            return
        named = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        self.keywords = {n for n in self.NAMES if var_kw or n in named} | {n for n in self.EXTRA if n in named}
        if "agent_completions" not in self.keywords:
            raise TransitionError(f"external_transition {self.name} must accept agent_completions=... by keyword "
                                  f"(and optionally {', '.join(n for n in self.NAMES if n != 'agent_completions')}).")

    def __call__(self, node: Node, completions: list[str], row: dict[str, Any], turn: int) -> list[str]:
        values = {
            "prompt": row.get("prompt", ""),
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
            raise user_failure(TransitionError, f"external_transition {self.name}", exc)
        if isinstance(out, str) or not isinstance(out, Sequence) or len(out) != self.num_agents:
            raise TransitionError(f"external_transition {self.name} must return a list of {self.num_agents} next "
                                  f"prompts (one per agent), got {out!r:.120}.")
        bad = [i for i, p in enumerate(out) if not isinstance(p, str)]
        if bad:
            raise TransitionError(f"external_transition {self.name} returned a non-string prompt for agent "
                                  f"{bad[0]}: {out[bad[0]]!r:.80}.")
        return list(out)


SampleFn = Callable[[list[Node]], list[Rollout]]
JointFn = Callable[[list[Rollout], int], list[list[str]]]
ScoreFn = Callable[[list[Node], list[list[str]], int], torch.Tensor]
NextPromptsFn = Callable[[Node, list[str], int], list[Any]]


def play_episodes(roots: list[Node], *, num_turns: int, joint_per_node: int, sample: SampleFn, joint: JointFn,
                  score: ScoreFn, next_prompts: Optional[NextPromptsFn], threshold: Optional[float],
                  timer: Optional[PhaseTimer] = None) -> list[Turn]:
    """Play every turn of a batch of episodes (rollout, score, transition; no update).

    Args:
        roots: the turn-1 nodes, one per prompt.
        joint_per_node: J, joint actions per node.
        sample: ``nodes -> [N] Rollout`` (K rows per node, node-major), the rollout phase.
        joint: ``(rollouts, nodes) -> [N][nodes * J]`` completions of every joint action.
        score: ``(nodes, completions, turn) -> [nodes * J]`` rewards (or ``[N, nodes * J]`` per agent),
            the score phase.
        next_prompts: ``(node, answer, turn) -> [N]`` prompts of the child node (None: one turn).
        threshold: a node whose mean reward is above it does not continue (None: every node does).
    Returns:
        One :class:`Turn` per turn played (fewer than ``num_turns`` if every branch ended early).
    """
    timer = timer or PhaseTimer()
    nodes, turns = roots, []
    for turn_number in range(1, num_turns + 1):
        with timer("rollout"):
            rollouts = sample(nodes)
        with timer("score"):
            completions = joint(rollouts, len(nodes))
            rewards = score(nodes, completions, turn_number)
        per_agent = rewards if rewards.dim() == 2 else None
        turn = Turn(nodes, rollouts, completions, rewards.mean(dim=0) if per_agent is not None else rewards,
                    agent_rewards=per_agent)
        turns.append(turn)
        children: list[Node] = []
        for i, node in enumerate(nodes):
            node_rewards = rewards[i * joint_per_node:(i + 1) * joint_per_node]
            ends = turn_number == num_turns or next_prompts is None or (
                threshold is not None and float(node_rewards.mean()) > threshold)
            for j in range(joint_per_node):
                if ends:
                    turn.children.append(None)
                    continue
                answer = [completions[a][i * joint_per_node + j] for a in range(len(completions))]
                with timer("transition"):
                    prompts = next_prompts(node, answer, turn_number)
                turn.children.append(len(children))
                children.append(Node(node.group, node.index, node.path + (j,), prompts,
                                     [h + [p] for h, p in zip(node.prompt_history, prompts)],
                                     [h + [c] for h, c in zip(node.response_history, answer)]))
        if not children:
            break
        nodes = children
    return turns
