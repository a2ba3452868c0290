"""MAHAGRPO: MAGRPO with HAPPO's sequential agent updates.

HAPPO (Kuba et al., "Trust Region Policy Optimisation in Multi-Agent Reinforcement Learning",
ICLR 2022, arXiv 2109.11251) updates the agents one after another, in a random order drawn anew
for every update, and weighs each agent's advantage by how much the agents updated before it
changed the probability of the joint action. With agents ``i_1, ..., i_n`` in this step's order,
agent ``i_m`` maximises the clipped surrogate of its own ratio ``r_m`` with the advantage

    M_m * A,    M_m = prod_{l < m} clip(pi_new^{i_l}(a^{i_l}) / pi_old^{i_l}(a^{i_l}), 1 - eps, 1 + eps)

(``M_1 = 1``; each factor the sequence-level ratio of that agent's completion of the joint action,
after its update, to the policy that sampled it). The multi-agent advantage decomposition lemma
makes this sequence of single-agent trust-region steps a monotonic improvement of the joint
objective, where independent simultaneous updates (MAGRPO, IPPO) are not. Here ``A`` is MAGRPO's
group-relative advantage of the joint action, so no critic is needed.

One optimizer step::

    order      a seeded permutation of the agents (a function of seed and global_step: resumable)
    for each agent of the order:
      update   the clipped-ratio loss with advantages M * A, backward, this agent's AdamW step
      ratio    the agent's new log-probs of its rows (no gradient) -> M *= clip(ratio)

It costs one extra forward pass per agent and step (the new log-probs) over MAGRPO's clipped
update. Joint actions must be aligned (completion k of every agent forms joint action k), so that
each row has one M.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...engine.config import check_choice, check_float, config_class, setting
from ...engine.state import PlayedBuffer
from ...engine.step import collective_passes, idle_passes, rows_log_probs
from ...engine.streams import Stream, stream_rng
from ...exceptions import ConfigError
from ...functional.losses import sequence_ratio
from .buffers import GroupBufferData, SequentialStepParts
from .config import JOINT_MODES, MAGRPOConfig
from .magrpo import MAGRPOTrainer

__all__ = ["MAHAGRPOConfig", "MAHAGRPOTrainer"]


@config_class
class MAHAGRPOConfig(MAGRPOConfig):
    """MAGRPO's settings; the clipped-ratio update is on (``ppo_clip_eps`` 0.2), joint actions aligned."""

    ppo_clip_eps: float = setting(0.2, "Clip range eps: of each agent's own token ratios (its clipped surrogate) "
                                       "and of each earlier agent's factor in M.",
                                  check_float(lambda v: 0 < v < 1, "in (0, 1)"))
    joint_mode: str = setting("aligned", "Must be 'aligned': each joint action is completion k of every agent.",
                              check_choice(*JOINT_MODES, aliases={"align": "aligned"}))

    def validate(self) -> None:
        super().validate()
        if self.joint_mode != "aligned":
            raise ConfigError("MAHAGRPO weighs each joint action by the ratios of the agents' completions in it, so "
                              "joint actions must be aligned: set joint_mode='aligned'.")


class MAHAGRPOTrainer(MAGRPOTrainer):
    """MAGRPO with sequential, HAPPO-weighted agent updates, in a random order per step.

    The arguments are :class:`MAGRPOTrainer`'s, with a :class:`MAHAGRPOConfig` (see the module
    docstring for the algorithm)."""

    config_class = MAHAGRPOConfig
    algorithm_name = "MAHAGRPO"

    def _accepted_config(self) -> type:
        return MAHAGRPOConfig

    def update_order(self) -> list[int]:
        """The agents in the order this optimizer step updates them (seeded by the run's seed and
        the step number, so a resumed run draws the same orders)."""
        rng = stream_rng(self.args.seed, Stream.UPDATE_ORDER, self.state.global_step)
        return [int(a) for a in rng.permutation(len(self.agents))]

    def optimizer_step(self, buffer: PlayedBuffer[GroupBufferData], groups: range) -> dict[str, float]:
        """The agents updated in :meth:`update_order`, each with its advantages weighted by the
        earlier agents' clipped ratios. A non-finite gradient is MAGRPO's per-agent rule. Each
        finished agent (its update, then its ratio) is kept in ``buffer.step_parts`` (a
        :class:`SequentialStepParts`, by position in the order), so train() called again after an
        interruption continues with the same order and weights."""
        if buffer.step_parts is None:
            buffer.step_parts = SequentialStepParts()
        parts: SequentialStepParts = buffer.step_parts
        eps = self.args.ppo_clip_eps
        order = self.update_order()
        weights = None  # [R] M of each row (joint action), None before the first agent
        for position, agent in enumerate(order):
            if position not in parts.updates:
                applied = self._updated([(b, parts.updates[i]) for i, b in enumerate(order[:position])])
                metrics = self._agent_update(buffer, agent, groups, applied, weights)
                metrics[f"agent_{agent}/update_position"] = float(position)
                if weights is not None:
                    metrics[f"agent_{agent}/advantage_weight_mean"] = float(weights.mean())
                parts.updates[position] = metrics
            if position < len(order) - 1:  # every process (collectives when sharded), rows or not
                if position not in parts.weights:
                    factor = self._clipped_ratio(buffer, agent, groups, eps)
                    parts.weights[position] = (weights if factor is None else
                                               factor if weights is None else weights * factor)
                weights = parts.weights[position]
        return self._step_result({agent: parts.updates[position] for position, agent in enumerate(order)})

    def _clipped_ratio(self, buffer: PlayedBuffer[GroupBufferData], agent: int, groups: range,
                       eps: float) -> Optional[torch.Tensor]:
        """``[R]`` clip(pi_new / pi_old, 1 - eps, 1 + eps) of the agent's completions of the rows,
        after its update (float64, no gradient); None when this process has no rows."""
        rows = self.agent_rows(buffer, agent, groups)
        passes = collective_passes(rows, self.args.micro_batch_size, self.dist, self.sharded)
        if rows is None:
            idle_passes(self.agents[agent], passes or 0, grad=False, autocast=self.autocast)
            return None
        with self.policy_compute(agent) as (policy, autocast):
            new = rows_log_probs(policy, rows, temperature=self.args.temperature,
                                 micro_groups=self.args.micro_batch_size, autocast=autocast, passes=passes)
        old = buffer.data.old_log_probs[(agent, groups.start)]
        mask = rows.rollout.completion_mask.to(new.device)
        return sequence_ratio(new, old.to(new.device), mask).clamp(1.0 - eps, 1.0 + eps).cpu()

    def _run_config_extra(self) -> dict[str, Any]:
        return {**super()._run_config_extra(), "sequential_updates": True}
