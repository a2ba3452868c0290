"""The actor-critic family (IAC, MAAC) on the shared engine. One buffer of prompts::

    rollout    every agent samples (K per prompt; a chain of turns with K = 1), batched per agent
    score      the reward function: one reward per joint action, or each agent's own
    advantage  the critics' values of every sampled state, computed once before any update (one
               padded forward per agent and turn); rewards less the reference-KL penalty; one-step
               TD targets r + discount * V(next); advantages target - V, standardised per agent and
               turn over the buffer (on every process together)
    update     per optimizer step of train_batch_size samples: each agent's policy-gradient loss
               and the critics' (clipped) squared error to the targets, one padded forward per agent;
               AdamW on agents and critics together

What differs between the trainers is where values come from (:meth:`_turn_values`) and which
module regresses them (:meth:`_agent_backward`, :meth:`_critic_backward`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ...engine import distributed as dist
from ...engine.metrics import record_turns
from ...engine.state import PlayedBuffer
from ...engine.step import AgentRows, concat_rollouts, policy_backward, select_rows
from ...engine.streams import Stream, stream_rng
from ...engine.timing import PhaseTimer
from ...engine.trainer import Trainer
from ...exceptions import ConfigError
from ...functional.logprobs import sequence_log_probs
from ...functional.losses import PolicyLossSpec, sequence_kl
from ...functional.returns import discounted_returns
from ...functional.values import group_moments, normalize_advantages, td_targets
from ...models.actor_critic import CausalLMWithValueHead, unwrap_policy
from ...rollout import Rollout
from .buffers import ActorCriticBufferData
from .config import ActorCriticConfig
from .critics import split_value_heads

__all__ = ["ActorCriticTrainerBase", "RolloutSample", "value_positions", "head_values"]

logger = logging.getLogger("comlrl")


@dataclass
class RolloutSample:
    """One agent's completion at one turn, as CoMLRL 1.4.3's ``metrics_callback`` receives it.

    Tensors are on the CPU: ``full_input_ids`` / ``attention_mask`` ``[prompt_len + response_len]``
    (no padding), the scalars ``[1]``. ``returns`` is the discounted return from this turn on (of
    the agent's KL-shaped rewards), ``advantage`` the TD error ``target - old_value``. Metadata:
    ``turn_idx``, ``generation_idx``, ``batch_item``, ``value_target``, and with a reference KL
    ``reference_kl``, ``reference_kl_penalty``, ``environment_reward``.
    """

    agent_idx: int
    prompt: str
    completion: str
    full_input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_len: int
    old_logprob: torch.Tensor
    old_value: torch.Tensor
    reward: torch.Tensor
    returns: torch.Tensor
    advantage: torch.Tensor
    normalized_advantage: Optional[torch.Tensor] = None
    metadata: dict[str, Any] = field(default_factory=dict)


def value_positions(ro: Rollout, critic_type: str) -> torch.Tensor:
    """``[R]`` positions of the value read from the sequence ``prompt + completion`` (prompts
    left-padded to ``P``): ``"v"`` the last prompt token (``P - 1``), ``"q"`` the last scored
    completion token (``P - 1 + length``)."""
    p = ro.prompt_ids.shape[1]
    if critic_type == "v":
        return torch.full((ro.prompt_ids.shape[0],), p - 1, dtype=torch.long)
    return (p - 1 + ro.lengths).long().cpu()


def head_values(model: CausalLMWithValueHead, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R]`` float32 values of ``model``'s head on ``hidden [R, L, H]`` at ``positions [R]``."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return model.value_head(hidden[rows, positions.to(hidden.device)]).squeeze(-1).float()


@dataclass
class _Losses:
    """What one module's backward reports (sums over this process's rows)."""

    policy: float = 0.0
    value: float = 0.0


def _row_value(per_agent: list[list[torch.Tensor]], agent: int, turn: int, row: int) -> torch.Tensor:
    """``[1]`` float32: row ``row`` of agent ``agent``'s turn ``turn`` of a ``[agent][turn] -> [R_t]`` field."""
    return per_agent[agent][turn][row].reshape(1).float()


def _as_given(advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The advantage function of rows whose ``returns`` are their advantages already."""
    return advantages


class ActorCriticTrainerBase(Trainer):
    """Base of :class:`~comlrl.trainers.actor_critic.IACTrainer` and
    :class:`~comlrl.trainers.actor_critic.MAACTrainer` (arguments: see those classes)."""

    config_class = ActorCriticConfig
    algorithm_name = "ActorCritic"
    #: the family's ``PlayedBuffer.data``: the base's fields, and one per key of :meth:`_turn_values`' extras
    buffer_data_class: type[ActorCriticBufferData] = ActorCriticBufferData
    legacy_resume_supported = False  # 1.4.3's actor-critic checkpoints: refused with a message

    def __init__(self, agent_model: Any = None, critic_model: Any = None, tokenizer: Any = None,
                 reward_func: Optional[Callable[..., Any]] = None, reward_processor: Optional[Callable] = None,
                 formatters: Any = None, args: Optional[ActorCriticConfig] = None, train_dataset: Any = None,
                 eval_dataset: Any = None, model_config: Optional[Mapping[str, Any]] = None,
                 wandb_config: Optional[Mapping[str, Any]] = None, metrics_callback: Optional[Callable] = None,
                 external_transition: Optional[Callable[..., Any]] = None, agents: Optional[Sequence[Any]] = None,
                 critics: Optional[Sequence[Any]] = None, *, num_agents: Optional[int] = None,
                 peft_config: Any = None):
        args = self._check_args(args)
        self._check_critic_arguments(args, critic_model, critics)
        if metrics_callback is not None and not callable(metrics_callback):
            raise ConfigError(f"metrics_callback must be callable (list of RolloutSample -> dict of floats), got "
                              f"{type(metrics_callback).__name__}.")
        self.metrics_callback = metrics_callback
        self._critic_inputs = (critic_model, critics, peft_config)
        agent_model, agents, self._given_heads = split_value_heads(agent_model, agents)
        super().__init__(args=args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                         tokenizer=tokenizer, model_config=model_config, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, reward_func=reward_func, reward_processor=reward_processor,
                         formatters=formatters, external_transition=external_transition, wandb_config=wandb_config,
                         eval_logger=None, eval_aggregator=None, peft_config=peft_config)
        del self._critic_inputs, self._given_heads
        self.agent_optimizers = self.optimizers
        self.critic_optimizers, self.critic_schedulers = (
            self._optimizers(self.critics, lr=self.args.critic_learning_rate) if self.critics else ([], []))
        self.critic_type = self.args.critic_type
        self.parallel_training = self.args.parallel_training
        self.rollout_buffers: list[list[RolloutSample]] = [[] for _ in range(self.num_agents)]  # CoMLRL's; empty

    # --- construction (the families fill in the critics) ------------------------------------
    def _check_critic_arguments(self, args: ActorCriticConfig, critic_model: Any, critics: Any) -> None:
        """Checks of the critic arguments that need no model (before anything is loaded)."""

    def _per_agent_rewards(self) -> bool:
        return True

    def _trained_models(self, resolved: Any) -> list[torch.nn.Module]:
        from ...checkpoint.rng import set_seed

        set_seed(self.args.seed)  # value heads initialised from the run's seed
        heads = self._given_heads or [None] * len(resolved.models)
        if len(heads) == 1 and len(resolved.models) > 1:  # agent_model given with a head: a copy each
            import copy

            heads = heads + [copy.deepcopy(heads[0]) for _ in range(len(resolved.models) - 1)]
        seen: set[int] = set()
        actors = []
        for i, (model, head) in enumerate(zip(resolved.models, heads)):
            actor = self._actor(model)
            if head is not None:
                if id(head) in seen:
                    import copy

                    head = copy.deepcopy(head)
                seen.add(id(head))
                actor.value_head = head.to(resolved.devices[i])
            actors.append(actor)
        critic_model, critics, peft_config = self._critic_inputs
        self.critics = self._build_critics(actors, resolved, critic_model, critics, peft_config)
        return actors

    def _actor(self, model: torch.nn.Module) -> CausalLMWithValueHead:
        """Agent ``model`` wrapped (with a value head when the agent is its own critic)."""
        return CausalLMWithValueHead(model, attach_value_head=False)

    def _build_critics(self, actors: list[CausalLMWithValueHead], resolved: Any, critic_model: Any, critics: Any,
                       peft_config: Any) -> list[CausalLMWithValueHead]:
        raise NotImplementedError

    def _policies(self) -> list[torch.nn.Module]:
        return [unwrap_policy(a) for a in self.agents]

    def _broadcast_modules(self) -> list[torch.nn.Module]:
        from ...engine.inputs import distinct_modules

        return distinct_modules(list(self.agents) + list(self.critics))

    def buffer_prompts(self) -> int:
        return max(1, math.ceil(self.args.rollout_buffer_size / self.args.num_generations))

    def _step_prompts(self) -> int:
        return max(1, math.ceil(self.args.train_batch_size / self.args.num_generations))

    def _buffer_order(self, indices: list[int], epoch: int) -> list[int]:
        """CoMLRL shuffles a buffer's samples before cutting it into optimizer steps: here the
        prompts, by a permutation drawn from (seed, epoch, first prompt), no global RNG used."""
        if len(indices) <= self._step_prompts():
            return list(indices)
        permutation = stream_rng(self.args.seed, Stream.BUFFER_ORDER, epoch, indices[0]).permutation(len(indices))
        return [indices[i] for i in permutation]

    def trained_slots(self):
        from ...checkpoint.manager import Slots

        slots = super().trained_slots()
        names = self._critic_slot_names()
        slots.modules.update(zip(names, self.critics))
        slots.optimizers.update(zip(names, self.critic_optimizers))
        slots.schedulers.update(zip(names, self.critic_schedulers))
        return Slots(slots.modules, slots.optimizers, slots.schedulers)

    def _critic_slot_names(self) -> list[str]:
        return [f"critic-{i}" for i in range(len(self.critics))]

    # --- the advantage phase --------------------------------------------------------------------
    def collect(self, mine: list[int], epoch: int, timer: PhaseTimer) -> PlayedBuffer[ActorCriticBufferData]:
        args = self.args
        turns = []
        if mine:
            turns = self.play_episodes(mine, epoch, timer)
        with timer("advantage"):
            data = self._advantages(turns)
        joint = discounted_returns([t.rewards for t in turns], [t.children for t in turns], args.num_generations,
                                   args.discount, args.num_turns)
        buffer = PlayedBuffer(turns, record_turns(turns, joint) if turns else {}, data)
        buffer.extra_metrics = self._buffer_metrics(data)
        if self.metrics_callback is not None:
            buffer.extra_metrics.update(self._averaged(self._callback_sums(turns, data), ""))
        return buffer

    def _advantages(self, turns: list) -> ActorCriticBufferData:
        """Values, KL-shaped rewards, TD targets and standardised advantages of every row, per agent
        and turn (``[agent][turn] -> [R_t]``), before any update, as the family's
        :attr:`buffer_data_class` (with :meth:`_turn_values`' extras per turn)."""
        args, n, k = self.args, self.num_agents, self.args.num_generations
        values: list[list[torch.Tensor]] = [[] for _ in range(n)]
        kls: list[list[torch.Tensor]] = [[] for _ in range(n)]
        shaped: list[list[torch.Tensor]] = [[] for _ in range(n)]
        extra: dict[str, list[Any]] = {}
        with torch.no_grad():
            for t, turn in enumerate(turns):
                turn_values, turn_extra = self._turn_values(turn)
                for key, value in turn_extra.items():
                    extra.setdefault(key, []).append(value)
                for a in range(n):
                    values[a].append(turn_values[a].double().cpu())
                    reward = (turn.agent_rewards[a] if turn.agent_rewards is not None else turn.rewards).double()
                    if args.reference_kl_enabled:
                        kl = self._rollout_kl(a, turn.rollouts[a])
                        kls[a].append(kl)
                        reward = reward - args.reference_kl_coef * kl
                    shaped[a].append(reward)
        children = [t.children for t in turns]
        targets = [td_targets(shaped[a], values[a], children, k, args.discount, args.num_turns) for a in range(n)]
        raw = [[g - v for g, v in zip(targets[a], values[a])] for a in range(n)]
        advantages = raw
        if args.advantage_normalization:
            moments = torch.zeros(n, args.num_turns, 3, dtype=torch.float64)
            for a in range(n):
                for t, adv in enumerate(raw[a]):
                    moments[a, t] = group_moments(adv, torch.zeros(len(adv), dtype=torch.long), 1)[0]
            moments = torch.tensor(dist.all_reduce_sum(moments.flatten().tolist(), self.dist),
                                   dtype=torch.float64).view(n, args.num_turns, 3)
            advantages = [[normalize_advantages(adv, torch.full((len(adv),), t, dtype=torch.long), moments[a])
                           for t, adv in enumerate(raw[a])] for a in range(n)]
        return self.buffer_data_class(values=values, targets=targets, raw_advantages=raw,
                                      advantages=[[x.float() for x in per] for per in advantages], shaped=shaped,
                                      kl=kls, **extra)

    def _turn_values(self, turn: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Each agent's ``[R_t]`` values of one turn's rows (no grad), and anything the update
        needs again, by the name of its field of :attr:`buffer_data_class` (stored there per turn:
        ``[turn]``)."""
        raise NotImplementedError

    def _rollout_kl(self, agent: int, ro: Rollout) -> torch.Tensor:
        """``[R]`` float64 KL estimate of each completion to the agent's reference policy."""
        policy = self._policies()[agent]
        policy.eval()
        with self.autocast():
            logp = sequence_log_probs(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                      self.args.temperature)
        return sequence_kl(logp, self.reference_log_probs(agent)(ro), ro.completion_mask).cpu()

    def _buffer_metrics(self, data: ActorCriticBufferData) -> dict[str, float]:
        """Per agent, over every process: mean value, TD error and (with the KL) reference KL."""
        n = self.num_agents
        sums = []
        for a in range(n):
            values, raw = data.values[a], data.raw_advantages[a]
            kl = data.kl[a]
            sums += [sum(float(v.sum()) for v in values), sum(float(r.sum()) for r in raw),
                     sum(float(x.sum()) for x in kl), float(sum(len(v) for v in values))]
        sums = dist.all_reduce_sum(sums, self.dist)
        metrics = {}
        for a in range(n):
            value, adv, kl, count = sums[4 * a:4 * a + 4]
            if count:
                metrics[f"agent_{a}/value_mean"] = value / count
                metrics[f"agent_{a}/td_error_mean"] = adv / count
                if self.args.reference_kl_enabled:
                    metrics[f"agent_{a}/reference_kl"] = kl / count
        return metrics

    # --- the update phase -------------------------------------------------------------------------
    def _row_index(self, turn: Any, groups: range) -> torch.Tensor:
        k = self.args.num_generations
        return torch.tensor([i * k + j for i, node in enumerate(turn.nodes) if node.group in groups for j in range(k)],
                            dtype=torch.long)

    def _agent_rows(self, buffer: PlayedBuffer[ActorCriticBufferData], agent: int,
                    groups: range) -> Optional[AgentRows]:
        """Agent ``agent``'s rows of every turn for the prompts ``groups``: the rollout, its TD targets
        (``returns``), and ``advantages`` / ``old_values`` in ``extras``."""
        data, k = buffer.data, self.args.num_generations
        parts, targets, adv, old, ids = [], [], [], [], []
        next_id = 0
        for t, turn in enumerate(buffer.turns):
            rows = self._row_index(turn, groups)
            if not len(rows):
                continue
            parts.append(select_rows(turn.rollouts[agent], rows))
            targets.append(data.targets[agent][t][rows])
            adv.append(data.advantages[agent][t][rows])
            old.append(data.values[agent][t][rows])
            count = len(rows) // k
            ids.append(torch.arange(next_id, next_id + count).repeat_interleave(k))
            next_id += count
        if not parts:
            return None
        return AgentRows(concat_rollouts(parts, self.tokenizers[agent].pad_token_id), torch.cat(targets),
                         torch.cat(ids), {"advantages": torch.cat(adv), "old_values": torch.cat(old)})

    def optimizer_step(self, buffer: PlayedBuffer[ActorCriticBufferData], groups: range) -> dict[str, float]:
        """One optimizer step of every agent and critic on the prompts ``groups`` (this process's)."""
        rows = [self._agent_rows(buffer, a, groups) for a in range(self.num_agents)]
        counts = dist.all_reduce_sum([len(r.returns) if r is not None else 0 for r in rows], self.dist)
        losses = [self._agent_backward(a, r, counts[a]) if r is not None else _Losses() for a, r in enumerate(rows)]
        critic_losses = self._critic_backward(buffer, groups)
        totals = dist.all_reduce_sum([x for s in losses + critic_losses for x in (s.policy, s.value)], self.dist)
        metrics, norms = self.step_modules(list(self.agents) + list(self.critics), self.optimizers +
                                        self.critic_optimizers, self.schedulers + self.critic_schedulers)
        if norms is None:
            return metrics
        for a in range(self.num_agents):
            metrics[f"agent_{a}/policy_loss"] = totals[2 * a]
            if self._agent_value_loss(a):
                metrics[f"agent_{a}/value_loss"] = totals[2 * a + 1]
            metrics[f"agent_{a}/grad_norm"] = norms[a]
        for c, name in enumerate(self._critic_names()):
            if len(critic_losses) > c:
                metrics[f"{name}/value_loss"] = totals[2 * (self.num_agents + c) + 1]
            metrics[f"{name}/grad_norm"] = norms[self.num_agents + c]
        return metrics

    def _critic_names(self) -> list[str]:
        return [f"critic_{i}" for i in range(len(self.critics))]

    def _agent_value_loss(self, agent: int) -> bool:
        """Whether the agent's own backward includes a value loss (reported as agent_i/value_loss)."""
        return False

    # CoMLRL's REINFORCE objective: -sum(advantage * sequence log-prob) / denominator
    loss_spec = PolicyLossSpec("reinforce", "sequence")

    def _policy_loss(self, logp: torch.Tensor, piece: AgentRows, denominator: float) -> torch.Tensor:
        """:attr:`loss_spec` on the rows' log-probs ``logp`` and their critic advantages."""
        adv = piece.extras["advantages"].to(logp.device)
        return self.loss_spec(logp, None, adv, piece.rollout.completion_mask, denominator)[0]

    def _agent_backward(self, agent: int, rows: AgentRows, denominator: float) -> _Losses:
        """Back-propagate agent ``agent``'s loss over ``rows``: the update phase's
        :func:`~comlrl.engine.step.policy_backward`, with the critic's advantages as given."""
        given = AgentRows(rows.rollout, rows.extras["advantages"], rows.groups)
        with self.policy_compute(agent) as (policy, autocast):
            out = policy_backward(policy, given, _as_given, temperature=self.args.temperature,
                                  denominator=denominator, micro_groups=self.args.micro_batch_size,
                                  loss=self.loss_spec, autocast=autocast)
        return _Losses(policy=out.loss)

    def _critic_backward(self, buffer: PlayedBuffer[ActorCriticBufferData], groups: range) -> list[_Losses]:
        """Back-propagate the losses of critics not trained inside :meth:`_agent_backward`."""
        return []

    # --- metrics_callback (CoMLRL's task metrics) -------------------------------------------------
    def _samples(self, turns: list, group: int, data: Optional[ActorCriticBufferData]) -> list[RolloutSample]:
        """The :class:`RolloutSample` of every agent and turn of the episode of prompt ``group``."""
        k, out = (len(turns[0].rollouts[0].texts) // len(turns[0].nodes) if turns else 1), []  # 1 in evaluation
        rows_of = {}
        for t, turn in enumerate(turns):
            rows_of[t] = [i * k + j for i, node in enumerate(turn.nodes) if node.group == group for j in range(k)]
        returns = None
        if data is not None:
            returns = [discounted_returns(data.shaped[a], [t.children for t in turns], k, self.args.discount,
                                          self.args.num_turns) for a in range(self.num_agents)]
        nan = torch.tensor([math.nan])
        for a in range(self.num_agents):
            for t, turn in enumerate(turns):
                ro = turn.rollouts[a]
                for r in rows_of[t]:
                    node = turn.nodes[r // k]
                    p_ids = ro.prompt_ids[r][ro.prompt_mask[r].bool()].cpu()
                    c_ids = ro.completion_ids[r][ro.completion_mask[r]].cpu()
                    reward = (turn.agent_rewards[a] if turn.agent_rewards is not None else turn.rewards)[r]
                    meta: dict[str, Any] = {"turn_idx": t, "generation_idx": r % k,
                                            "batch_item": self._row_of(node)}
                    old_value, advantage, normalized = nan, nan, None  # in evaluation: no buffer data
                    if data is not None:
                        meta["value_target"] = _row_value(data.targets, a, t, r)
                        old_value = _row_value(data.values, a, t, r)
                        advantage = _row_value(data.raw_advantages, a, t, r)
                        normalized = _row_value(data.advantages, a, t, r)
                        if self.args.reference_kl_enabled:
                            kl = float(data.kl[a][t][r])
                            meta.update(reference_kl=kl, reference_kl_penalty=self.args.reference_kl_coef * kl,
                                        environment_reward=float(reward))
                    out.append(RolloutSample(
                        agent_idx=a, prompt=str(node.prompts[a]), completion=ro.texts[r],
                        full_input_ids=torch.cat([p_ids, c_ids]), attention_mask=torch.ones(len(p_ids) + len(c_ids),
                                                                                            dtype=torch.long),
                        prompt_len=len(p_ids), response_len=len(c_ids), old_logprob=nan.clone(),
                        old_value=old_value, reward=reward.reshape(1).float(),
                        returns=returns[a][t][r].reshape(1).float() if returns is not None else nan.clone(),
                        advantage=advantage, normalized_advantage=normalized, metadata=meta))
        return out

    def _row_of(self, node: Any) -> Any:
        table = self._tables.get("eval" if getattr(self, "_in_eval", False) else "train")
        return table[1].item(node.index) if table is not None else None

    def _callback_sums(self, turns: list, data: Optional[ActorCriticBufferData]) -> dict[str, list[float]]:
        """``metrics_callback`` on every episode's samples: ``{key: [sum, count]}`` over this process's
        episodes (values that are not numbers are skipped)."""
        sums: dict[str, list[float]] = {}
        for g in sorted({node.group for node in turns[0].nodes}) if turns else []:
            result = self.metrics_callback(self._samples(turns, g, data))
            if not isinstance(result, Mapping):
                continue
            for key, value in result.items():
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    continue
                entry = sums.setdefault(str(key), [0.0, 0.0])
                entry[0] += number
                entry[1] += 1
        return sums

    def _averaged(self, sums: dict[str, list[float]], prefix: str) -> dict[str, float]:
        """Means of :meth:`_callback_sums` over every process (every process must call it)."""
        merged: dict[str, list[float]] = {}
        for part in dist.gather_objects(sums, self.dist):
            for key, (total, count) in part.items():
                entry = merged.setdefault(key, [0.0, 0.0])
                entry[0] += total
                entry[1] += count
        return {f"{prefix}{key}": total / count for key, (total, count) in sorted(merged.items()) if count}

    def _eval_episodes(self, table: Any, indices: list[int]):
        self._eval_turns: list[list] = []
        return super()._eval_episodes(table, indices)

    def _eval_completions(self, turns, group: int) -> list[list[str]]:
        if self.metrics_callback is not None and group == 0:
            self._eval_turns.append(turns)  # one evaluation batch's episodes, for the callback
        return super()._eval_completions(turns, group)

    def _custom_eval_metrics(self, table: Any, indices: list[int], completions) -> dict[str, float]:
        if self.metrics_callback is None:
            return {}
        self._in_eval = True
        try:
            sums: dict[str, list[float]] = {}
            for turns in self._eval_turns:
                for key, (total, count) in self._callback_sums(turns, None).items():
                    entry = sums.setdefault(key, [0.0, 0.0])
                    entry[0] += total
                    entry[1] += count
        finally:
            self._in_eval, self._eval_turns = False, []
        return self._averaged(sums, "eval/")

    # --- fingerprints, run config, export ---------------------------------------------------------
    def fingerprint_extra(self) -> dict[str, Any]:
        from ...adapters import AdapterAgent, base_fingerprint
        from ...checkpoint.fingerprint import model_fingerprint

        extra: dict[str, Any] = {"critics": [model_fingerprint(c) for c in self.critics]}
        policies = self._policies()
        if any(isinstance(p, AdapterAgent) for p in policies):
            extra["lora_bases"] = [base_fingerprint(p.shared) for p in policies]
            extra["lora_adapters"] = [p.fingerprint()["adapter_config"] for p in policies]
        if self.args.reference_kl_enabled:
            extra["references"] = [base_fingerprint(r if r is not None else p.shared)
                                   for r, p in zip(self.reference_models, policies)]
        return extra

    def _run_config_extra(self) -> dict[str, Any]:
        return {"critic_type": self.args.critic_type, "num_critics": len(self.critics)}
