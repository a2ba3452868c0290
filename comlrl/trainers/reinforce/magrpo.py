"""MAGRPO: Multi-Agent Group Relative Policy Optimization (arXiv 2508.04652), on the shared engine.

One buffer of prompts::

    rollout    every agent samples K completions per node of the episode tree, batched
    score      the reward function scores each node's joint actions (one call per joint action, as CoMLRL)
    advantage  tree returns; per agent, its return relative to its group (the node's K samples)
    update     per optimizer step of train_batch_size prompts, per agent: the policy-gradient loss
               (with the reference-KL penalty on the returns when enabled), backward, AdamW

With one agent MAGRPO is GRPO. The named variants change only the baseline.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ...engine import distributed as dist
from ...engine.metrics import record_turns
from ...engine.state import PlayedBuffer
from ...engine.step import (ADVANTAGE_WEIGHTS, OLD_LOG_PROBS, AgentRows, StepLoss, collective_passes, concat_rollouts,
                           idle_passes, policy_backward, rows_log_probs, select_rows, step_denominator)
from ...engine.timing import PhaseTimer
from ...engine.trainer import Trainer
from ...exceptions import ConfigError
from ...functional.advantages import group_advantages
from ...functional.joint import cross_returns
from ...functional.losses import PolicyLossSpec
from ...functional.returns import discounted_returns, tree_size
from .buffers import GroupBufferData
from .config import MAGRPOConfig

__all__ = ["MAGRPOConfig", "MAGRPOTrainer"]

logger = logging.getLogger("comlrl")


class MAGRPOTrainer(Trainer):
    """Multi-Agent Group Relative Policy Optimization for N cooperating causal LMs.

    Args (CoMLRL 1.4.3's, in its order):
        agent_model: a model name / local path (or, for comlrl, a loaded model) copied into
            ``num_agents`` agents.
        agents: one model name or loaded model per agent, instead of ``agent_model``.
        num_agents: how many agents ``agent_model`` makes (default: ``args.num_agents``, 2).
        tokenizer: one shared tokenizer or one per agent; loaded from model names when None.
        model_config: loading options (``dtype``, ``attn_implementation``, ``model_kwargs``,
            ``special_tokens``).
        train_dataset: a ``datasets.Dataset`` or list of dicts with a ``prompt`` column (or any
            columns, given ``formatters``); may be set later (``trainer.train_dataset = ...``).
        eval_dataset: rows for :meth:`evaluate`, evaluated every ``eval_interval`` prompts.
        reward_func: ``f(completions1, ..., completionsN) -> list[float]``, one per joint action
            (keyword ``prompts`` / ``batch_items`` optional; see :mod:`comlrl.engine.rewards`).
        reward_processor: ``float -> float`` applied to every reward.
        formatters: ``f(item[, external_prompts]) -> prompt``, one shared or one per agent.
        external_transition: for ``num_turns > 1``: the agents' next prompts from a joint answer.
        wandb_config: W&B settings (``project``, ``name``, ``id``, ``resume``, ...); None = no W&B.
        eval_logger, eval_aggregator: task-metric callbacks of evaluation (both or neither).
        args: a :class:`MAGRPOConfig` (defaults if None).
        peft_config: a ``peft.LoraConfig``: the agents become LoRA adapters on ONE frozen base
            ``agent_model`` (see :mod:`comlrl.adapters`).
        dataset_type: deprecated (CoMLRL 1.3.9-1.4.2's argument, refused by 1.4.3): accepted with a
            one-time ``FutureWarning``, recorded in the run config, otherwise ignored.
    """

    config_class = MAGRPOConfig
    algorithm_name = "MAGRPO"
    supports_sharding = True

    def __init__(self, agent_model: Any = None, agents: Optional[Sequence[Any]] = None,
                 num_agents: Optional[int] = None, tokenizer: Any = None,
                 model_config: Optional[Mapping[str, Any]] = None, train_dataset: Any = None, eval_dataset: Any = None,
                 reward_func: Optional[Callable[..., Any]] = None, reward_processor: Optional[Callable] = None,
                 formatters: Any = None, external_transition: Optional[Callable[..., Any]] = None,
                 wandb_config: Optional[Mapping[str, Any]] = None, eval_logger: Optional[Callable] = None,
                 eval_aggregator: Optional[Callable] = None, args: Optional[MAGRPOConfig] = None, *,
                 peft_config: Any = None, dataset_type: Optional[str] = None):
        super().__init__(args=args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                         tokenizer=tokenizer, model_config=model_config, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, reward_func=reward_func, reward_processor=reward_processor,
                         formatters=formatters, external_transition=external_transition, wandb_config=wandb_config,
                         eval_logger=eval_logger, eval_aggregator=eval_aggregator, peft_config=peft_config,
                         dataset_type=dataset_type)
        self.advantage_mode = self.args.advantage_mode
        if self.args.advantage_mode != type(self).config_class().advantage_mode:
            logger.info("comlrl: %s trains with advantage_mode=%r from its config.", type(self).__name__,
                        self.args.advantage_mode)
        self.loss_spec = self.policy_loss_spec()
        joint = self._joint_per_node()
        nodes, total = tree_size(self.args.num_turns, joint)
        if total > self.args.max_joint_actions:
            raise ConfigError(f"num_generations={self.args.num_generations}, {self.num_agents} agents, joint_mode="
                              f"{self.args.joint_mode!r} and num_turns={self.args.num_turns} score up to {total} joint "
                              f"actions per prompt ({joint} per node, {nodes} nodes), above max_joint_actions="
                              f"{self.args.max_joint_actions}. Lower num_generations or num_turns, use joint_mode="
                              "'aligned', or raise max_joint_actions.")

    def _accepted_config(self) -> type:
        return MAGRPOConfig

    def policy_loss_spec(self) -> PolicyLossSpec:
        """The policy loss of every update of the run (built once, when the trainer is): the
        clipped-ratio loss when the config uses ratios (``ppo_clip_eps`` or several update epochs),
        else the loss at ratio 1; a subclass returns another registered loss here."""
        args = self.args
        return PolicyLossSpec("clipped" if args.ratio_loss else "reinforce", args.loss_type, args.max_new_tokens,
                              args.ppo_clip_eps)

    def _joint_per_node(self) -> int:
        k, n = self.args.num_generations, self.num_agents
        return k ** n if self.args.joint_mode == "cross" and n > 1 else k

    # --- one buffer ----------------------------------------------------------------------------
    def collect(self, mine: list[int], epoch: int, timer: PhaseTimer) -> PlayedBuffer[GroupBufferData]:
        """Rollout, score and returns for this process's prompts of the buffer."""
        turns = self.play_episodes(mine, epoch, timer)
        if not turns:  # this process has no prompt in the buffer
            return PlayedBuffer([], {}, GroupBufferData(returns=[]))
        with timer("advantage"):
            joint = discounted_returns([t.rewards for t in turns], [t.children for t in turns],
                                       self._joint_per_node(), self.args.discount, self.args.num_turns)
            returns = [self._agent_returns(g, len(t.nodes)) for t, g in zip(turns, joint)]
        return PlayedBuffer(turns, record_turns(turns, joint), GroupBufferData(returns=returns))

    def _agent_returns(self, joint: torch.Tensor, num_nodes: int) -> list[torch.Tensor]:
        """Each agent's ``[nodes * K]`` completion returns from the joint-action returns: the joint
        action's (aligned), or the mean over the joint actions the completion took part in (cross)."""
        if self.args.joint_mode != "cross" or self.num_agents == 1:
            return [joint] * len(self.agents)
        return list(cross_returns(joint.reshape(num_nodes, -1), self.args.num_generations, self.num_agents))

    def agent_rows(self, buffer: PlayedBuffer[GroupBufferData], agent: int, groups: range) -> Optional[AgentRows]:
        """Agent ``agent``'s completions of every turn for the prompts ``groups`` of the batch (None
        if this process has none)."""
        k = self.args.num_generations
        parts, returns, ids = [], [], []
        next_id = 0
        for turn, turn_returns in zip(buffer.turns, buffer.data.returns):
            nodes = [i for i, node in enumerate(turn.nodes) if node.group in groups]
            if not nodes:
                continue
            rows = torch.tensor([i * k + j for i in nodes for j in range(k)], dtype=torch.long)
            parts.append(select_rows(turn.rollouts[agent], rows))
            returns.append(turn_returns[agent][rows])
            ids.append(torch.arange(next_id, next_id + len(nodes)).repeat_interleave(k))
            next_id += len(nodes)
        if not parts:
            return None
        pad = self.tokenizers[agent].pad_token_id
        return AgentRows(concat_rollouts(parts, pad), torch.cat(returns), torch.cat(ids))

    def advantages(self, returns: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return group_advantages(returns, groups, self.args.advantage_mode, self.args.advantage_normalization)

    def update_passes(self) -> int:
        return self.args.num_update_epochs

    def optimizer_step(self, buffer: PlayedBuffer[GroupBufferData], groups: range) -> dict[str, float]:
        """One optimizer step on the prompts ``groups`` (this process's share), agent after agent:
        each agent's backward, then its update, its gradients freed before the next agent's
        backward, so that the peak memory holds one agent's gradients, not every agent's. The
        agents' losses are independent (fixed rollouts), so the weights are those of stepping all
        agents together, bit for bit.

        Each agent's update is checked on its own: a non-finite gradient stops training
        (``nonfinite="raise"``) or drops that agent's update (``"skip"``, counted in
        ``agent_i/skipped_steps``; ``train/skipped_steps`` counts steps that updated no agent, which
        leave ``global_step`` unchanged). Finished agents are kept in ``buffer.step_parts`` (agent
        -> its update's metrics): train() called again after an interruption updates only those not
        yet updated."""
        if buffer.step_parts is None:
            buffer.step_parts = {}
        parts: dict[int, dict[str, float]] = buffer.step_parts
        for a in range(len(self.agents)):
            if a not in parts:
                parts[a] = self._agent_update(buffer, a, groups, self._updated([(b, parts[b]) for b in range(a)]))
        return self._step_result({a: parts[a] for a in range(len(self.agents))})

    @staticmethod
    def _updated(done: Sequence[tuple[int, Mapping[str, float]]]) -> list[str]:
        """The agents of ``done`` ((agent, its update's metrics) of this step) whose update was applied."""
        return [f"agent {a}" for a, metrics in done if f"agent_{a}/skipped_steps" not in metrics]

    def _step_result(self, per_agent: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """The optimizer step's metrics from each agent's update (the learning rate logged: agent
        0's); the step counts in ``global_step`` unless no agent was updated."""
        metrics: dict[str, float] = {}
        for a in sorted(per_agent, reverse=True):
            metrics.update(per_agent[a])
        if self._updated(list(per_agent.items())):
            self.state.global_step += 1
        else:
            metrics["train/skipped_steps"] = 1.0
        return metrics

    def _agent_update(self, buffer: PlayedBuffer[GroupBufferData], agent: int, groups: range, applied: list[str],
                      weights: Optional[torch.Tensor] = None) -> dict[str, float]:
        """Agent ``agent``'s backward (``weights``: see :meth:`agent_backward`) and update in this
        optimizer step; ``applied`` names the agents this step already updated. Returns its metrics."""
        out = self.agent_backward(buffer, agent, groups, weights)
        totals = dist.all_reduce_sum(list(self.loss_totals(out)), self.dist)
        metrics, norms = self.step_modules([self.agents[agent]], [self.optimizers[agent]], [self.schedulers[agent]],
                                           count=False, names=[f"agent {agent}"], applied=applied)
        if norms is None:
            metrics.pop("train/skipped_steps", None)
            metrics[f"agent_{agent}/skipped_steps"] = 1.0
            return metrics
        metrics.update(self.agent_metrics(agent, totals, norms[0]))
        return metrics

    def agent_backward(self, buffer: PlayedBuffer[GroupBufferData], agent: int, groups: range,
                       weights: Optional[torch.Tensor] = None) -> Optional[StepLoss]:
        """Back-propagate agent ``agent``'s loss on the prompts ``groups``; ``weights`` (``[R]``,
        one per row) multiply its advantages. None when this process has no rows. Every process
        calls it (its collectives: the loss denominator; with sharded agents, every pass)."""
        args, spec = self.args, self.loss_spec
        ratio = spec.uses_old_log_probs
        if ratio:  # on every process, rows or not: a later step of the buffer may have some
            self._keep_old_log_probs(buffer, agent)
        rows = self.agent_rows(buffer, agent, groups)
        denominator = step_denominator(rows, spec.loss_type, spec.max_new_tokens, self.dist)
        passes = collective_passes(rows, args.micro_batch_size, self.dist, self.sharded)
        reference = self.reference_log_probs(agent) if args.reference_kl_enabled else None
        if rows is None:
            idle_passes(self.agents[agent], passes or 0, reference=reference, grad=True, autocast=self.autocast)
            return None
        key = (agent, groups.start)
        old = buffer.data.old_log_probs.get(key)
        if ratio and old is not None:
            rows.extras[OLD_LOG_PROBS] = old
        if weights is not None:
            rows.extras[ADVANTAGE_WEIGHTS] = weights
        with self.policy_compute(agent) as (model, autocast):
            out = policy_backward(
                model, rows, self.advantages, temperature=args.temperature, denominator=denominator,
                micro_groups=args.micro_batch_size, loss=spec, reference=reference, kl_coef=args.reference_kl_coef,
                autocast=autocast, keep_log_probs=ratio and old is None, passes=passes)
        if out.log_probs is not None:  # this step's first update: its forward was the sampling policy's
            buffer.data.old_log_probs[key] = out.log_probs
        return out

    def _keep_old_log_probs(self, buffer: PlayedBuffer[GroupBufferData], agent: int) -> None:
        """Before an agent's first update on a buffer, its policy is the one that sampled: the
        log-probs of the rows of the buffer's OTHER optimizer steps are taken now (no gradient),
        those of this step come from this step's own forward (no extra pass when a buffer is one
        optimizer step). Later steps and passes compare against these."""
        kept, read = buffer.data.old_log_probs, buffer.data.sampled_policy_read
        if buffer.steps_done or agent in read:
            return
        model = self.agents[agent]
        with self.policy_compute(agent) as (policy, autocast):
            for index, step in enumerate(buffer.steps):
                if index == 0:  # the buffer's first step: this very step, read by its own forward
                    continue
                rows = self.agent_rows(buffer, agent, step)
                passes = collective_passes(rows, self.args.micro_batch_size, self.dist, self.sharded)
                if rows is None:
                    idle_passes(model, passes or 0, grad=False, autocast=self.autocast)
                    continue
                kept[(agent, step.start)] = rows_log_probs(policy, rows, temperature=self.args.temperature,
                                                           micro_groups=self.args.micro_batch_size,
                                                           autocast=autocast, passes=passes)
        read.add(agent)  # only once every step's are kept: an interruption above reads them all again

    @staticmethod
    def loss_totals(out: Optional[StepLoss]) -> tuple[float, ...]:
        """What an agent's step reports, summed over processes (:meth:`agent_metrics` reads it)."""
        return (out.loss, out.kl_sum, out.rows, out.clipped, out.tokens) if out else (0.0,) * 5

    def agent_metrics(self, agent: int, totals: Sequence[float], norm: float) -> dict[str, float]:
        loss, kl_sum, rows, clipped, tokens = totals
        metrics = {f"agent_{agent}/loss": loss, f"agent_{agent}/grad_norm": norm}
        if self.args.reference_kl_enabled and rows:
            metrics[f"agent_{agent}/reference_kl"] = kl_sum / rows
        if self.args.ppo_clip_eps is not None and tokens:
            metrics[f"agent_{agent}/clip_fraction"] = clipped / tokens  # TRL's clip_ratio
        return metrics

    def fingerprint_extra(self) -> dict[str, Any]:
        from ...adapters import AdapterAgent, base_fingerprint

        extra: dict[str, Any] = {}
        if any(isinstance(m, AdapterAgent) for m in self.agents):
            extra["lora_bases"] = [base_fingerprint(m.shared) for m in self.agents]
            extra["lora_adapters"] = [m.fingerprint()["adapter_config"] for m in self.agents]
        if self.args.reference_kl_enabled:
            if "_reference_prints" not in self.__dict__:  # frozen models: taken once (before any sharding)
                self._reference_prints = [base_fingerprint(r if r is not None else m.shared)
                                          for r, m in zip(self.reference_models, self.agents)]
            extra["references"] = self._reference_prints
        return extra

    def _run_config_extra(self) -> dict[str, Any]:
        return {"advantage_mode": self.args.advantage_mode}
