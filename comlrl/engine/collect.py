"""The rollout and score phases, shared by training and evaluation of every trainer family:
a batch of prompts in, the played episode tree out.

:class:`Collector` knows how the agents sample (the rollout backend, sampling settings, chat
rendering, per-row seeds), how joint actions are formed, how the reward is called (per task item and
turn, through :class:`~comlrl.engine.rewards.RewardFunction`: once per joint action, or once when
batched) and how an external transition's prompts are formatted for the next turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..functional.joint import cross_combinations, joint_actions_per_group
from ..rollout import Rollout, RolloutBackend, SamplingParams, derive_seed
from .episode import ExternalTransition, Node, Turn, play_episodes
from .prompts import Formatter, Prompt, check_prompt, render_prompt
from .rewards import RewardFunction
from .timing import PhaseTimer

__all__ = ["PromptBatch", "Collector", "SeedFn", "train_seeds", "eval_seeds"]

SeedFn = Callable[[int, Node, int], int]  # (agent, node, generation) -> seed


@dataclass(frozen=True)
class PromptBatch:
    """Prompts handled together: ``indices[g]`` is the dataset row of group ``g``."""

    indices: tuple[int, ...]
    rows: tuple[dict[str, Any], ...]
    prompts: tuple[tuple[Prompt, ...], ...]   # [num_agents][G]

    def __len__(self) -> int:
        return len(self.indices)


def train_seeds(seed: int, epoch: int) -> SeedFn:
    """Training samples: seeded by (seed, agent, epoch, example, generation[, tree path])."""
    def seed_of(agent: int, node: Node, generation: int) -> int:
        path = (node.path,) if node.path else ()
        return derive_seed(seed, "train", agent, epoch, node.index, generation, *path)
    return seed_of


def eval_seeds(seed: int) -> SeedFn:
    """Evaluation samples: the same at every evaluation, so evaluations compare like with like."""
    def seed_of(agent: int, node: Node, generation: int) -> int:
        path = (node.path,) if node.path else ()
        return derive_seed(seed, "eval", agent, node.index, generation, *path)
    return seed_of


class Collector:
    """Plays episodes for a :class:`PromptBatch` (see :func:`comlrl.engine.episode.play_episodes`).

    Args:
        backend: the rollout backend of the agents.
        tokenizers, eos_token_ids: per agent.
        chat: per agent, whether its prompts are chat messages (rendered with its template).
        formatters: per agent, for later turns' external prompts.
        reward: the reward function.
        transition: the external transition, or None (single turn).
        joint_mode: ``"aligned"`` or ``"cross"``.
        passthrough: use the transition's prompts as they are (no formatter).
        autocast: context manager factory for the rollout forwards (mixed precision).
    """

    def __init__(self, *, backend: RolloutBackend, sampling: SamplingParams, tokenizers: Sequence[Any],
                 eos_token_ids: Sequence[Sequence[int]], chat: Sequence[bool], formatters: Sequence[Formatter],
                 reward: RewardFunction, transition: Optional[ExternalTransition], joint_mode: str,
                 passthrough: bool, autocast: Callable[[], contextlib.AbstractContextManager]):
        self.backend, self.sampling = backend, sampling
        self.tokenizers, self.eos_token_ids = list(tokenizers), [list(e) for e in eos_token_ids]
        self.chat, self.formatters = list(chat), list(formatters)
        self.reward, self.transition = reward, transition
        self.joint_mode, self.passthrough, self.autocast = joint_mode, passthrough, autocast
        self.num_agents = len(self.tokenizers)

    def joint_per_node(self, num_generations: int) -> int:
        return joint_actions_per_group(self.joint_mode if self.num_agents > 1 else "aligned", num_generations,
                                       self.num_agents)

    def play(self, batch: PromptBatch, *, num_generations: int, num_turns: int, seed_of: SeedFn,
             threshold: Optional[float], timer: Optional[PhaseTimer] = None) -> list[Turn]:
        """Every turn of the batch's episodes: rollout, score, transition (no update)."""
        n = self.num_agents
        roots = [Node(g, idx, (), [batch.prompts[a][g] for a in range(n)], [[batch.prompts[a][g]] for a in range(n)],
                      [[] for _ in range(n)]) for g, idx in enumerate(batch.indices)]
        joint = self.joint_per_node(num_generations)
        return play_episodes(
            roots, num_turns=num_turns, joint_per_node=joint,
            sample=lambda nodes: self.sample(nodes, num_generations, seed_of),
            joint=lambda rollouts, count: self.joint_completions(rollouts, count, num_generations),
            score=lambda nodes, completions, turn: self.score(nodes, completions, batch, joint),
            next_prompts=(lambda node, answer, turn: self.next_prompts(node, answer, batch.rows[node.group], turn))
            if self.transition is not None else None,
            threshold=threshold, timer=timer)

    def sample(self, nodes: list[Node], k: int, seed_of: SeedFn) -> list[Rollout]:
        """Each agent's K completions for every node: one batched call per agent (or one for all
        agents together where the backend can stack them)."""
        agents = range(self.num_agents)
        with self.autocast():
            return self.backend.sample(
                [[render_prompt(self.tokenizers[a], node.prompts[a], self.chat[a]) for node in nodes] for a in agents],
                [[[seed_of(a, node, g) for g in range(k)] for node in nodes] for a in agents], self.sampling,
                self.eos_token_ids, [not self.chat[a] for a in agents])

    def joint_completions(self, rollouts: list[Rollout], num_nodes: int, k: int) -> list[list[str]]:
        """``[N][nodes * J]``: agent a's completion in each joint action, node-major.

        Aligned: joint action k of node i is row i*K+k of every agent. Cross: joint action j of
        node i combines, for each agent a, row i*K + combos[j, a].
        """
        if self.joint_mode == "aligned" or self.num_agents == 1:
            return [list(r.texts) for r in rollouts]
        combos = cross_combinations(k, self.num_agents)
        return [[ro.texts[i * k + int(c)] for i in range(num_nodes) for c in combos[:, a]]
                for a, ro in enumerate(rollouts)]

    def score(self, nodes: list[Node], completions: list[list[str]], batch: PromptBatch, joint: int) -> torch.Tensor:
        """``[nodes * J]`` rewards (``[N, nodes * J]`` when the reward gives each agent its own): each
        node's J joint actions through :class:`~comlrl.engine.rewards.RewardFunction` (one call per
        joint action, or one batched call), with the node's prompts and its task item's row."""
        out = []
        for i, node in enumerate(nodes):
            part = [c[i * joint:(i + 1) * joint] for c in completions]
            out.append(self.reward(part, node.prompts[0], batch.rows[node.group], agent_prompts=node.prompts))
        if not out:
            return torch.zeros(0, dtype=torch.float64)
        if any(r.dim() == 2 for r in out):  # per-agent rewards (actor-critic): [N, nodes * J]
            return torch.cat([r if r.dim() == 2 else r.expand(self.num_agents, -1) for r in out], dim=1)
        return torch.cat(out)

    def next_prompts(self, node: Node, answer: list[str], row: dict[str, Any], turn: int) -> list[Any]:
        """The child node's prompts: the transition's, as they are (``passthrough``) or through each
        agent's formatter with the task's ``prompt`` replaced (CoMLRL's convention)."""
        raw = self.transition(node, answer, row, turn)  # type: ignore[misc]
        if self.passthrough:
            return [check_prompt(p, a, f"turn {turn + 1}", "Return text from external_transition.")
                    for a, p in enumerate(raw)]
        out = []
        for a, (formatter, text) in enumerate(zip(self.formatters, raw)):
            value = formatter({**row, "prompt": text}, external_prompts=text)
            out.append(check_prompt(value, a, f"turn {turn + 1}", "Make the formatter return text for external "
                                                                  "prompts (or set external_prompt_passthrough)."))
        return out
