"""MADPO: multi-agent direct preference optimisation, on the shared engine.

    pairs      every agent samples preference_num_candidates completions per prompt (candidate j of
               every agent is joint candidate j), the task reward scores the joint candidates (one
               call per prompt), pairs of joint candidates are kept by pair_selection
    reference  each agent's log-probabilities of the pairs under the policy that generated them,
               computed once for the pair set (dpo_reference='policy'; 'none': CoMLRL's
               reference-free loss)
    update     per train_batch_size pairs: each agent's DPO loss of the JOINT preference (its own
               margin plus the partners' margins held constant), one padded forward of the
               chosen and rejected completions per agent, AdamW
    epochs     num_train_epochs passes over the pairs, in a seeded order per epoch

A checkpoint is saved once the pair set exists (pairs and reference log-probabilities inside, so a
resume never samples them again), then as for every trainer (epochs, save_steps).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ...engine import distributed as dist
from ...engine.metrics import episode_metrics, merge_records
from ...engine.schedule import TrainingLoop
from ...engine.streams import Stream, stream_rng
from ...engine.timing import PhaseTimer
from ...engine.trainer import Trainer
from ...exceptions import ConfigError
from ...functional.logprobs import sequence_log_probs
from ...functional.preference import dpo_logits, multi_agent_dpo_loss, select_pairs
from ...rollout import derive_seed
from .centralized import TaggedCentralizedComparatorAdapter
from .collaboration import CentralizedCollaboration
from .config import MADPOConfig
from .pairs import AgentPreferenceTensors, PairSet, PreferencePair, pair_batch

__all__ = ["MADPOConfig", "MADPOTrainer", "PreferencePair", "AgentPreferenceTensors"]

_HELD_OUT_SET = 1_000_003  # the pair-set id of preference_pairs(): no training set ever has it

logger = logging.getLogger("comlrl")


class MADPOTrainer(Trainer):
    """Multi-agent DPO for N cooperating causal LMs (or one centralised actor of N roles).

    Args (CoMLRL 1.4.3's, in its order): as :class:`~comlrl.trainers.reinforce.MAGRPOTrainer`,
    with a :class:`MADPOConfig`; and ``centralized_comparator_adapter`` (keyword): the adapter of
    ``collaboration_mode="centralized"`` (default :class:`TaggedCentralizedComparatorAdapter`),
    ``peft_config``: LoRA agents on one base; ``dataset_type``: deprecated, as for MAGRPO.
    """

    config_class = MADPOConfig
    default_config_cls = MADPOConfig  # CoMLRL's name
    algorithm_name = "MADPO"
    _phases = ("pairs", "train")
    legacy_resume_supported = False  # 1.4.3's preference checkpoints: refused with a message

    def __init__(self, agent_model: Any = None, agents: Optional[Sequence[Any]] = None,
                 num_agents: Optional[int] = None, tokenizer: Any = None,
                 model_config: Optional[Mapping[str, Any]] = None, train_dataset: Any = None, eval_dataset: Any = None,
                 reward_func: Optional[Callable[..., Any]] = None, reward_processor: Optional[Callable] = None,
                 formatters: Any = None, external_transition: Optional[Callable[..., Any]] = None,
                 wandb_config: Optional[Mapping[str, Any]] = None, eval_logger: Optional[Callable] = None,
                 eval_aggregator: Optional[Callable] = None, args: Optional[MADPOConfig] = None, *,
                 centralized_comparator_adapter: Any = None, peft_config: Any = None,
                 dataset_type: Optional[str] = None):
        args = self._check_args(args)
        adapter = centralized_comparator_adapter if centralized_comparator_adapter is not None \
            else TaggedCentralizedComparatorAdapter()
        for method in ("build_prompt", "parse_completion"):
            if not callable(getattr(adapter, method, None)):
                raise ConfigError(f"centralized_comparator_adapter.{method} must be callable; "
                                  f"{type(adapter).__name__} has none. Use TaggedCentralizedComparatorAdapter().")
        self.centralized_comparator_adapter = adapter
        self.centralized_collaboration: Optional[CentralizedCollaboration] = None
        if args.collaboration_mode == "centralized":
            if agents is not None and len(agents) != 1:
                raise ConfigError(f"Centralized collaboration requires exactly one actor model (one policy writes "
                                  f"every role's part); got {len(agents)} agents.")
            if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != 1:
                raise ConfigError(f"Centralized collaboration requires one actor tokenizer; got {len(tokenizer)}.")
            if not callable(reward_func):
                raise ConfigError("reward_func must be a callable: f(completions1, ..., completionsN) -> list of "
                                  "floats (one completions list per role).")
            if num_agents is not None and num_agents != args.num_agents:
                raise ConfigError(f"num_agents must match args.num_agents (the role count): {num_agents} vs "
                                  f"{args.num_agents}.")
            self.centralized_collaboration = CentralizedCollaboration(adapter, formatters, reward_func,
                                                                      args.num_agents)
            formatters, reward_func, num_agents = self.centralized_collaboration.build_prompt, \
                self.centralized_collaboration, 1
        super().__init__(args=args, agent_model=agent_model, agents=agents, num_agents=num_agents,
                         tokenizer=tokenizer, model_config=model_config, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, reward_func=reward_func, reward_processor=reward_processor,
                         formatters=formatters, external_transition=external_transition, wandb_config=wandb_config,
                         eval_logger=eval_logger, eval_aggregator=eval_aggregator, peft_config=peft_config,
                         dataset_type=dataset_type)
        self._phase = "pairs"          # "pairs": the pair set is still to be made; "train": DPO epochs
        self._pair_set: Optional[PairSet] = None
        self._set_id = 0               # which pair set (the iterative variants make one per iteration)

    # --- construction -------------------------------------------------------------------------
    def _warn_count(self, count: int) -> None:
        if self.centralized_collaboration is None:
            super()._warn_count(count)

    @property
    def num_roles(self) -> int:
        return self.centralized_collaboration.num_roles if self.centralized_collaboration else self.num_agents

    # --- the schedule ---------------------------------------------------------------------------
    def is_complete(self) -> bool:
        return self._phase != "pairs" and self.state.epoch >= self.args.num_train_epochs

    def run_schedule(self, loop: TrainingLoop, progress: Any) -> None:
        if self._phase == "pairs":
            self._new_pair_set(loop)
        if self._pair_set is None or not len(self._pair_set):
            logger.warning("comlrl: %s: no pair of candidates had different rewards; nothing to train on.",
                           type(self).__name__)
            self._skip_pair_set()
            return
        self._train_pair_set(loop, progress)

    def _skip_pair_set(self) -> None:
        """No pairs: the set's training is done."""
        self.state.epoch = self.args.num_train_epochs

    def _train_pair_set(self, loop: TrainingLoop, progress: Any) -> None:
        """num_train_epochs of DPO over the pair set."""
        while self.state.epoch < self.args.num_train_epochs:
            loop.run_epoch(progress)

    def _new_pair_set(self, loop: TrainingLoop) -> None:
        """Make this set's pairs and their reference log-probabilities, log, and checkpoint."""
        timer = PhaseTimer(self.device)
        pairs, record = self._generate_pairs(timer)
        pairs = self._training_pairs(pairs, timer)
        with timer("reference"):
            ref = self._reference_log_probs(pairs)
        self._pair_set = PairSet(pairs, ref)
        self._phase = self._phase_after_pairs()
        self.state.epoch, self.state.items_in_epoch = 0, 0
        self._reset_pending()
        metrics = episode_metrics(merge_records([record] if record else [], 1, self.num_agents, self.dist), "train", "")
        metrics = {k: v for k, v in metrics.items() if not k.startswith("turn_")}
        metrics.update({"preference/pairs": float(len(pairs)), **self._pair_set_metrics(), **timer.metrics()})
        loop.log(metrics)  # a row of its own only as a run's first; else part of the next step's row
        loop.checkpoint()

    def _pair_set_metrics(self) -> dict[str, float]:
        return {}

    def _training_pairs(self, pairs: list[PreferencePair], timer: PhaseTimer) -> list[PreferencePair]:
        """The pairs the set trains on, from the ones just generated (replay may add older ones)."""
        return pairs

    def _phase_after_pairs(self) -> str:
        return "train"

    def epoch_order(self, epoch: int) -> list[int]:
        """The pairs in a seeded order of (seed, pair set, epoch)."""
        count = len(self._pair_set) if self._pair_set is not None else 0
        return stream_rng(self.args.seed, Stream.PAIR_ORDER, self._set_id, epoch).permutation(count).tolist()

    def total_steps(self) -> Optional[int]:
        if self._pair_set is None:
            return None
        return math.ceil(len(self._pair_set) / self.args.train_batch_size) * self.args.num_train_epochs

    def eval_due(self, start: int, count: int) -> bool:
        """CoMLRL's MADPO cadence: before every eval_interval-th update."""
        every = self.args.eval_interval
        return bool(every) and self.state.global_step % every == 0

    # --- pairs ----------------------------------------------------------------------------------
    def _seed_of(self, tag: str):
        seed, set_id = self.args.seed, self._set_id

        def seed_of(agent: int, node: Any, generation: int) -> int:
            return derive_seed(seed, tag, set_id, agent, node.index, generation)
        return seed_of

    def preference_pairs(self, dataset: Any = None) -> list[PreferencePair]:
        """Preference pairs of ``dataset`` (default ``eval_dataset``), made as MADPO makes its
        training pairs: the current agents sample ``preference_num_candidates`` joint candidates per
        prompt, the reward function scores them, ``pair_selection`` pairs them (the iterative
        trainers' ``"comparator_reward"``, which needs a comparator, pairs by reward gap here). For
        held-out checks, e.g. :meth:`MARLHFTrainer.reward_model_accuracy`.

        The candidates come from seeds of their own (never a training set's), and every global
        random state is restored afterwards: training after this call is exactly as without it.
        Under torchrun every process must call it; each returns every pair.
        """
        from ...engine.evaluation import restored_rng
        from ...engine.prompts import PromptTable

        self._check_open()
        source = dataset if dataset is not None else self.eval_dataset
        if source is None:
            raise ConfigError("preference_pairs() needs prompts: pass a dataset (e.g. [{'prompt': ...}, ...]) or set "
                              "eval_dataset.")
        table = PromptTable.build(source, "dataset", self.formatters)
        saved = self._set_id
        self._set_id = _HELD_OUT_SET
        try:
            with restored_rng():
                pairs, _ = MADPOTrainer._generate_pairs(self, PhaseTimer(), table)
        finally:
            self._set_id = saved
        return pairs

    def _generate_pairs(self, timer: PhaseTimer, table: Any = None) -> tuple[list[PreferencePair], dict]:
        """Every prompt's pairs, on every process (each samples its share of the prompts)."""
        table = table if table is not None else self._table("train")
        collector = self._collector(table)
        k = self.args.preference_num_candidates
        local: list[PreferencePair] = []
        turns_seen = []
        indices = list(range(len(table)))
        chunk = self.args.rollout_buffer_size * self.dist.world_size
        for start in range(0, len(indices), chunk):
            mine = dist.shard(indices[start:start + chunk], self.dist)
            if not mine:
                continue
            batch = self._batch(table, mine)
            turn = collector.play(batch, num_generations=k, num_turns=1, seed_of=self._seed_of("preference"),
                                  threshold=None, timer=timer)[0]
            turns_seen.append(turn)
            with timer("pairs"):
                for g, index in enumerate(mine):
                    local.extend(self._pairs_of_prompt(turn, g, index, k))
        record = record_turns_list(turns_seen)
        gathered = dist.gather_objects(local, self.dist)
        return [p for part in gathered for p in part], record

    def _pairs_of_prompt(self, turn: Any, group: int, index: int, k: int) -> list[PreferencePair]:
        """The pairs of one prompt's k joint candidates (rows group*k .. group*k + k - 1)."""
        rewards = turn.rewards[group * k:(group + 1) * k].tolist()
        rng = stream_rng(self.args.seed, Stream.PREFERENCE_PAIRS, self._set_id, index)
        mode = self.args.pair_selection  # an iterative config's comparison-only mode: by reward gap here
        chosen = select_pairs(rewards, "reward_gap" if mode == "comparator_reward" else mode,
                              self.args.preference_pairs_per_sample, rng)
        mean = float(np.mean(rewards)) if rewards else 0.0
        return [self._pair(turn, group * k + w, turn, group * k + lose, rewards[w], rewards[lose], mean, index)
                for w, lose in chosen]

    def _pair(self, win_turn: Any, w: int, lose_turn: Any, lo: int, win_reward: float, lose_reward: float,
              mean: float, index: int, **extra: Any) -> PreferencePair:
        """A pair of row ``w`` of ``win_turn`` over row ``lo`` of ``lose_turn`` (every agent's)."""
        tensors, prompts = [], []
        for a in range(len(win_turn.rollouts)):
            wr, lr = win_turn.rollouts[a], lose_turn.rollouts[a]
            tensors.append(AgentPreferenceTensors(
                wr.prompt_ids[w][wr.prompt_mask[w].bool()].cpu().clone(),
                wr.completion_ids[w][wr.completion_mask[w]].cpu().clone(),
                lr.completion_ids[lo][lr.completion_mask[lo]].cpu().clone()))
            node = win_turn.nodes[w // (len(wr.texts) // len(win_turn.nodes))]
            prompts.append(node.prompts[a] if isinstance(node.prompts[a], str) else str(node.prompts[a]))
        return PreferencePair(prompts=prompts, winner_completions=[r.texts[w] for r in win_turn.rollouts],
                              loser_completions=[r.texts[lo] for r in lose_turn.rollouts], agent_tensors=tensors,
                              winner_reward=float(win_reward), loser_reward=float(lose_reward),
                              candidate_reward_mean=mean, item_index=index, **extra)

    # --- the update -----------------------------------------------------------------------------
    def _pair_log_probs(self, agent: int, pairs: Sequence[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([P] chosen, [P] rejected)`` sequence log-probabilities of agent ``agent`` (with grad
        unless under no_grad): one padded forward of its 2P completions."""
        policy = self._policies()[agent]
        policy.eval()  # no dropout: the margins are those of the policy itself
        device = self.agent_devices[agent]
        batch = pair_batch(pairs, agent, self.tokenizers[agent].pad_token_id)
        with self.autocast():
            logp = sequence_log_probs(policy, batch.prompt_ids.to(device), batch.prompt_mask.to(device),
                                      batch.completion_ids.to(device))
        sums = torch.where(batch.completion_mask.to(device), logp, torch.zeros((), device=device)).sum(dim=1)
        return sums[:len(pairs)], sums[len(pairs):]

    def _reference_log_probs(self, pairs: list[PreferencePair]) -> torch.Tensor:
        """``[P, N, 2]`` float64 log-probabilities of every pair under the current policies (zeros
        with dpo_reference='none'), each process computing its share."""
        out = torch.zeros(len(pairs), self.num_agents, 2, dtype=torch.float64)
        if self.args.dpo_reference == "none" or not pairs:
            return out
        positions = dist.shard(list(range(len(pairs))), self.dist)
        size = max(self.args.train_batch_size, 8)
        local = []
        with torch.no_grad():
            for start in range(0, len(positions), size):
                chunk = [pairs[i] for i in positions[start:start + size]]
                local.append(torch.stack([torch.stack(self._pair_log_probs(a, chunk), dim=1).double().cpu()
                                          for a in range(self.num_agents)], dim=1))
        gathered = dist.gather_objects(torch.cat(local) if local else out[:0], self.dist)
        return torch.cat(gathered)

    def train_buffer(self, indices: list[int], epoch: int, timer: PhaseTimer) -> dict[str, float]:
        """One optimizer step of every agent on the pairs ``indices`` (this process: its share)."""
        assert self._pair_set is not None
        args = self.args
        mine = dist.shard(list(indices), self.dist)
        pairs = [self._pair_set.pairs[i] for i in mine]
        ref = self._pair_set.ref[mine] if mine else torch.zeros(0, self.num_agents, 2, dtype=torch.float64)
        with timer("update"):
            stats = self._dpo_backward(pairs, ref, float(len(indices)))
            totals = dist.all_reduce_sum(stats, self.dist)
            metrics, norms = self.step_modules(self.agents, self.optimizers, self.schedulers)
        per_pair = args.environment_steps_per_pair if args.use_environment_step else 1
        self.state.env_step += per_pair * len(indices)
        if norms is None:
            return metrics
        n, count = self.num_agents, float(len(indices))
        for a in range(n):
            metrics[f"agent_{a}/dpo_loss"] = totals[4 * a]
            metrics[f"agent_{a}/chosen_reward"] = totals[4 * a + 1] / count
            metrics[f"agent_{a}/rejected_reward"] = totals[4 * a + 2] / count
            metrics[f"agent_{a}/grad_norm"] = norms[a]
        metrics["train/dpo_loss"] = sum(totals[4 * a] for a in range(n)) / n
        metrics["train/preference_accuracy"] = totals[4 * n] / count
        metrics["train/margin_mean"] = totals[4 * n + 1] / count
        candidate_mean = totals[4 * n + 2] / count
        metrics.update({"turn_1/reward_mean": candidate_mean, "turn_1/expected_return": candidate_mean})
        return metrics

    def _dpo_backward(self, pairs: list[PreferencePair], ref: torch.Tensor, denominator: float) -> list[float]:
        """Back-propagate every agent's DPO loss over ``pairs``; returns the sums the step's metrics
        need: per agent (loss, chosen reward, rejected reward, 0), then accuracy, margin, candidate
        reward mean. One forward per agent holding every agent's graph, or, with micro_batch_size,
        a no-grad pass for the partners' margins and then micro-batches per agent."""
        n, beta = self.num_agents, self.args.dpo_beta
        out = [0.0] * (4 * n + 3)
        if not pairs:
            return out

        def margins_of(a: int, part: list[PreferencePair], part_ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
            chosen, rejected = self._pair_log_probs(a, part)
            r = part_ref[:, a].to(chosen.device)
            return dpo_logits(chosen, rejected, r[:, 0], r[:, 1], beta), chosen, rejected, r

        size = self.args.micro_batch_size
        if size is None:
            parts = [margins_of(a, pairs, ref) for a in range(n)]
            detached = [p[0].detach().double().cpu() for p in parts]
            total = sum(detached)
            loss = 0
            for a, (margin, chosen, rejected, r) in enumerate(parts):
                partners = (total - detached[a]).to(margin.device)
                agent_loss = multi_agent_dpo_loss(margin, partners, denominator)
                loss = loss + agent_loss if isinstance(loss, int) else loss + agent_loss.to(loss.device)
                self._add_agent_stats(out, a, agent_loss, chosen, rejected, r, beta)
            loss.backward()
        else:
            with torch.no_grad():
                detached = [margins_of(a, pairs, ref)[0].double().cpu() for a in range(n)]
            total = sum(detached)
            for a in range(n):
                for start in range(0, len(pairs), size):
                    part = pairs[start:start + size]
                    margin, chosen, rejected, r = margins_of(a, part, ref[start:start + size])
                    partners = (total - detached[a])[start:start + size].to(margin.device)
                    agent_loss = multi_agent_dpo_loss(margin, partners, denominator)
                    agent_loss.backward()
                    self._add_agent_stats(out, a, agent_loss, chosen, rejected, r, beta)
        out[4 * n] = float((total > 0).double().sum())
        out[4 * n + 1] = float(total.sum())
        out[4 * n + 2] = float(sum(p.candidate_reward_mean for p in pairs))
        return out

    @staticmethod
    def _add_agent_stats(out: list[float], a: int, loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor,
                         ref: torch.Tensor, beta: float) -> None:
        out[4 * a] += float(loss.detach())
        out[4 * a + 1] += float((beta * (chosen.detach() - ref[:, 0].to(chosen.dtype))).sum())
        out[4 * a + 2] += float((beta * (rejected.detach() - ref[:, 1].to(rejected.dtype))).sum())

    # --- evaluation (centralised: the task sees the roles) --------------------------------------
    def _eval_completions(self, turns, group: int) -> list[list[str]]:
        if self.centralized_collaboration is None:
            return super()._eval_completions(turns, group)
        row = self._table("eval").item(turns[0].nodes[group].index)
        split = [self.centralized_collaboration.split(t.completions[0][group], row) for t in turns]
        return [[outputs[r] for outputs in split] for r in range(self.num_roles)]

    # --- checkpoints ------------------------------------------------------------------------------
    def trained_slots(self):
        from ...checkpoint.manager import Slots

        slots = super().trained_slots()
        data = self._pair_set.to_tensors("pairs.") if self._pair_set is not None else {}
        return Slots(slots.modules, slots.optimizers, slots.schedulers, data={**data, **self._extra_tensors()})

    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def algorithm_state(self) -> dict[str, Any]:
        return {"phase": self._phase, "set_id": self._set_id,
                "pairs": len(self._pair_set) if self._pair_set is not None else None}

    def load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        from ...exceptions import CheckpointError

        phase, count = state.get("phase"), state.get("pairs")
        if phase not in self._phases or not isinstance(state.get("set_id"), int) or \
                (count is not None and not isinstance(count, int)):
            raise CheckpointError(f"this checkpoint's preference progress {state!r:.120} is malformed.")
        self._phase, self._set_id = phase, state["set_id"]
        self._pair_set = None
        if count is not None:
            try:
                self._pair_set = PairSet.from_tensors(tensors or {}, "pairs.", decode=self._decode)
            except (KeyError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"this checkpoint's preference pairs are malformed ({exc}).") from None
            if len(self._pair_set) != count:
                raise CheckpointError(f"this checkpoint says {count} pairs but holds {len(self._pair_set)}.")

    def _decode(self, agent: int, ids: torch.Tensor) -> str:
        return self.tokenizers[agent].decode(ids.tolist(), skip_special_tokens=True)

    def _run_config_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.centralized_collaboration is not None:
            extra.update(collaboration_mode="centralized", num_roles=self.num_roles, num_actor_models=1)
        return extra


def record_turns_list(turns: list) -> dict:
    """One metrics record (see :func:`comlrl.engine.metrics.record_turns`) of several batches'
    single turns."""
    if not turns:
        return {}
    rewards = torch.cat([t.rewards for t in turns]).cpu()
    lengths = [torch.cat([t.rollouts[a].lengths.float().cpu() for t in turns]) for a in range(len(turns[0].rollouts))]
    return {"rewards": [rewards], "returns": [rewards], "lengths": [lengths]}
