"""Iterative MADPO and MARLHF: several rounds of generate, compare, train.

Each iteration:

    snapshot   the agents as they start the iteration, when policy_checkpoint_dir is set or the
               comparator is 'history' (transformers folders, policy_checkpoints/iteration_NNNN)
    pairs      the current policy's candidates against the comparator's candidates of the same
               index (comparators: comlrl.trainers.preference.comparators), both scored by the task
               reward (MARLHFIter may score with its previous reward model), pairs by pair_selection
    replay     this iteration's pairs are written as a shard (JSONL + safetensors); the pairs trained
               on come from the newest shard ('current'), the newest k, all, or a lambda-decayed
               mix of them; optional reward-distribution plots (matplotlib PNG + JSON)
    train      MADPOIter: num_train_epochs of DPO (reference: the policy starting the iteration);
               MARLHFIter: a fresh reward model on the pairs, then num_train_epochs of the online phase

Checkpoints hold every shard, so a resume needs nothing outside the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import wandb  # noqa: F401  (CoMLRL's module global)

from ...engine import distributed as dist
from ...engine.timing import PhaseTimer
from ...exceptions import CheckpointError, ConfigError
from ...functional.preference import lambda_decay_weights, replay_draws, reward_histogram, select_comparison_pairs
from ...rollout import make_backend
from .comparators import ApiComparator, load_comparator_models
from .config import MADPOIterConfig, MARLHFIterConfig
from .madpo import MADPOTrainer
from .marlhf import MARLHFTrainer
from .pairs import AgentPreferenceTensors, PairSet, PreferencePair, write_shard

__all__ = ["MADPOIterConfig", "MADPOIterTrainer", "MARLHFIterConfig", "MARLHFIterTrainer", "PreferenceReplayShard"]

logger = logging.getLogger("comlrl")


@dataclass
class PreferenceReplayShard:
    """One iteration's pairs on disk (CoMLRL's record: 1-based iteration, file, pair count)."""

    iteration: int
    path: str
    num_pairs: int


@dataclass
class _Candidates:
    """One prompt's joint candidates of one side: per agent texts and token ids (None: only text,
    tokenised with the agent's tokenizer when a pair needs it), and their rewards."""

    texts: list[list[str]]
    ids: Optional[list[list[torch.Tensor]]]
    rewards: list[float]


class _Iterative:
    """What MADPOIter and MARLHFIter share (mixed in before the trainer)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        a = self.args
        self._iteration = 0
        self._replay: list[tuple[int, PairSet]] = []
        self._root: Optional[Path] = None
        self._distribution: dict[str, list[float]] = {}
        if a.comparator_generation_mode == "centralized" and self.centralized_collaboration is None:
            raise ConfigError("a centralized comparator for decentralized agents is not supported yet; use "
                              "comparator_generation_mode='decentralized' (or collaboration_mode='centralized').")
        if a.log_reward_distribution:
            self._distribution_range()
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ConfigError("log_reward_distribution=True draws with matplotlib: pip install 'comlrl[plot]'.")
        uses_history = a.comparator_policy == "history" or a.policy_checkpoint_dir is not None
        from ...adapters import AdapterAgent

        if a.comparator_policy == "history" and any(isinstance(p, AdapterAgent) for p in self._policies()):
            raise ConfigError("comparator_policy='history' with LoRA agents is not supported yet; use 'current', "
                              "'model' or 'api'.")
        self._snapshots = uses_history
        self._api = ApiComparator(a) if a.comparator_policy == "api" else None
        self._comparator_models: Optional[tuple[list[Any], list[Any]]] = None
        if a.comparator_policy == "model":
            names = list(a.comparator_agents) if a.comparator_agents is not None else \
                [a.comparator_model_name] * self.num_agents
            if len(names) not in (1, self.num_agents):
                raise ConfigError(f"comparator_agents has {len(names)} names for {self.num_agents} agents; give one "
                                  "or one per agent.")
            devices = self._comparator_devices()
            self._comparator_models = load_comparator_models(names * (self.num_agents // len(names)),
                                                             self.model_config, devices)

    # --- output folders (beside the metrics) ---------------------------------------------------------
    def _folder(self, configured: Optional[str], name: str) -> Path:
        return Path(configured) if configured else (self._root or Path(self.args.output_dir)) / name

    def _comparator_devices(self) -> list[Any]:
        from ...engine.devices import DeviceScheduler

        if self.args.comparator_devices is None:
            return list(self.agent_devices)
        return DeviceScheduler.resolve_devices(self.args.comparator_devices, self.num_agents, kind="comparator_devices")

    # --- the schedule -----------------------------------------------------------------------------------
    def _finished(self) -> bool:
        return self._iteration >= self.args.num_iterations

    def _run_schedule(self, loop: Any, progress: Any) -> None:
        self._root = loop.checkpoint_dir or Path(self.args.output_dir)
        while self._iteration < self.args.num_iterations:
            self._set_id = self._iteration
            if self._phase == "pairs":
                self._save_snapshot()
                self._new_pair_set(loop)
            if self._pair_set is None or not len(self._pair_set):
                logger.warning("comlrl: %s iteration %d: no pairs to train on.", type(self).__name__,
                               self._iteration + 1)
                self._skip_pair_set()
                self._next_iteration()
                loop.checkpoint()
                continue
            self._train_pair_set(loop, progress)
            self._next_iteration()

    def _next_iteration(self) -> None:
        self._iteration += 1
        self._phase = "pairs"
        self.state.epoch, self.state.items_in_epoch = 0, 0

    def _epoch_position(self, epoch: float) -> float:
        """Rows count epochs over the whole run: iteration i's epoch e is i * num_train_epochs + e."""
        return self._iteration * self.args.num_train_epochs + epoch

    # --- snapshots of the policy (history comparator, policy_checkpoint_dir) ----------------------------
    def _snapshot_dir(self, iteration: int) -> Path:
        return self._folder(self.args.policy_checkpoint_dir, "policy_checkpoints") / f"iteration_{iteration:04d}"

    def _save_snapshot(self) -> None:
        if not self._snapshots:
            return
        from ...engine.persistence import _write_agents

        target = self._snapshot_dir(self._iteration)
        dist.main_process_first_result(lambda: _write_agents(target, self._exported(), False), self.dist)

    def _history_models(self) -> tuple[list[Any], list[Any]]:
        """The agents as they started iteration ``max(0, i - comparator_history_k)``."""
        from transformers import AutoModelForCausalLM

        source = self._snapshot_dir(max(0, self._iteration - (self.args.comparator_history_k or 1)))
        models = []
        for a, device in enumerate(self.agent_devices):
            folder = source / f"agent_{a}"
            if not (folder / "config.json").is_file():
                raise CheckpointError(f"comparator_policy='history' needs the saved policy {folder}, which is missing; "
                                      "keep policy_checkpoint_dir with the run's checkpoints.")
            models.append(AutoModelForCausalLM.from_pretrained(folder).to(device).eval().requires_grad_(False))
        return models, list(self.tokenizers)

    # --- pairs against the comparator --------------------------------------------------------------------
    def _generate_pairs(self, timer: PhaseTimer) -> tuple[list[PreferencePair], dict]:
        from .madpo import record_turns_list

        a = self.args
        table = self._table("train")
        k_current, k_comparator = a.preference_num_candidates, a.comparator_num_candidates or a.preference_num_candidates
        collector = self._collector(table)
        comparator = self._comparator_collector(table)
        local, turns_seen = [], []
        distribution: dict[str, list[float]] = {"target": [], "comparator": []}
        indices = list(range(len(table)))
        chunk = a.rollout_buffer_size * self.dist.world_size
        try:
            for start in range(0, len(indices), chunk):
                mine = dist.shard(indices[start:start + chunk], self.dist)
                if not mine:
                    continue
                batch = self._batch(table, mine)
                turn = collector.play(batch, num_generations=k_current, num_turns=1,
                                      seed_of=self._seed_of("preference-current"), threshold=None, timer=timer)[0]
                turns_seen.append(turn)
                theirs = self._comparator_candidates(comparator, batch, k_comparator, timer)
                with timer("pairs"):
                    for g, index in enumerate(mine):
                        ours = self._candidates_of(turn, g, k_current)
                        self._rescore(ours, theirs[g], batch.rows[g])
                        distribution["target"].extend(ours.rewards)
                        distribution["comparator"].extend(theirs[g].rewards)
                        local.extend(self._comparison_pairs(turn, g, index, ours, theirs[g]))
        finally:
            if comparator is not None and comparator is not collector:
                comparator.backend.close()
        gathered = dist.gather_objects((local, distribution), self.dist)
        self._distribution = {key: [v for _, d in gathered for v in d[key]] for key in ("target", "comparator")}
        return [p for part, _ in gathered for p in part], record_turns_list(turns_seen)

    def _comparator_collector(self, table: Any) -> Any:
        """A collector sampling the comparator (None for the API)."""
        policy = self.args.comparator_policy
        if policy == "api":
            return None
        if policy in ("current", "current_copy"):
            return self._collector(table)
        models, tokenizers = self._history_models() if policy == "history" else self._comparator_models
        from ...engine.inputs import eos_token_ids

        collector = self._collector(table)
        collector.backend = make_backend(self.args.rollout_backend, models, tokenizers, seed=self.args.seed)
        collector.tokenizers = list(tokenizers)
        collector.eos_token_ids = [list(eos_token_ids(m, t)) for m, t in zip(models, tokenizers)]
        return collector

    def _comparator_candidates(self, collector: Any, batch: Any, count: int, timer: PhaseTimer) -> list[_Candidates]:
        """Each prompt's comparator candidates, scored by the task reward."""
        if collector is not None:
            turn = collector.play(batch, num_generations=count, num_turns=1,
                                  seed_of=self._seed_of("preference-comparator"), threshold=None, timer=timer)[0]
            same_tokens = self.args.comparator_policy != "model"
            return [self._candidates_of(turn, g, count, with_ids=same_tokens) for g in range(len(batch))]
        out = []
        with timer("comparator_api"):
            for g in range(len(batch)):
                row = batch.rows[g]
                texts = [self._api.candidates(str(batch.prompts[a][g]), a, row, count) for a in range(self.num_agents)]
                width = min(len(t) for t in texts)
                texts = [t[:width] for t in texts]
                rewards = self.reward(texts, batch.prompts[0][g], row).tolist() if width else []
                out.append(_Candidates(texts, None, rewards))
        return out

    @staticmethod
    def _candidates_of(turn: Any, group: int, k: int, with_ids: bool = True) -> _Candidates:
        rows = range(group * k, (group + 1) * k)
        texts = [[ro.texts[r] for r in rows] for ro in turn.rollouts]
        ids = [[ro.completion_ids[r][ro.completion_mask[r]].cpu().clone() for r in rows] for ro in turn.rollouts] \
            if with_ids else None
        return _Candidates(texts, ids, turn.rewards[group * k:(group + 1) * k].tolist())

    def _rescore(self, ours: _Candidates, theirs: _Candidates, row: Any) -> None:
        """Scores of both sides by another judge than the task reward (MARLHFIter's reward model)."""

    def _comparison_pairs(self, turn: Any, group: int, index: int, ours: _Candidates, theirs: _Candidates
                          ) -> list[PreferencePair]:
        a = self.args
        rng = np.random.default_rng([a.seed, 11, self._set_id, index])
        chosen = select_comparison_pairs(ours.rewards, theirs.rewards, a.pair_selection, a.preference_pairs_per_sample,
                                         rng)
        k = len(ours.rewards)
        mean = float(np.mean(ours.rewards + theirs.rewards)) if ours.rewards or theirs.rewards else 0.0
        pairs = []
        for side, j in chosen:
            win, lose = (ours, theirs) if side == "current" else (theirs, ours)
            tensors, prompts = [], []
            for agent, ro in enumerate(turn.rollouts):
                row = group * k
                tensors.append(AgentPreferenceTensors(ro.prompt_ids[row][ro.prompt_mask[row].bool()].cpu().clone(),
                                                      self._completion_ids(win, agent, j),
                                                      self._completion_ids(lose, agent, j)))
                node = turn.nodes[group]
                prompts.append(node.prompts[agent] if isinstance(node.prompts[agent], str) else str(node.prompts[agent]))
            pairs.append(PreferencePair(
                prompts=prompts, winner_completions=[t[j] for t in win.texts],
                loser_completions=[t[j] for t in lose.texts], agent_tensors=tensors,
                winner_reward=float(win.rewards[j]), loser_reward=float(lose.rewards[j]), candidate_reward_mean=mean,
                raw_rewards=[float(win.rewards[j]), float(lose.rewards[j])], target_raw_reward=float(ours.rewards[j]),
                comparator_raw_reward=float(theirs.rewards[j]), item_index=index))
        return pairs

    def _completion_ids(self, side: _Candidates, agent: int, j: int) -> torch.Tensor:
        if side.ids is not None:
            return side.ids[agent][j]
        tokenizer = self.tokenizers[agent]
        ids = tokenizer(side.texts[agent][j], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return torch.tensor(ids, dtype=torch.long)

    # --- replay ----------------------------------------------------------------------------------------
    def _training_pairs(self, pairs: list[PreferencePair], timer: PhaseTimer) -> list[PreferencePair]:
        a, number = self.args, self._iteration + 1
        current = PairSet(pairs)
        if pairs:
            self._replay.append((number, current))
            folder = self._folder(a.preference_replay_dir, "preference_replay")
            dist.main_process_first_result(lambda: write_shard(folder, number, current), self.dist)
        if a.preference_replay_mode == "current":
            chosen = list(pairs)
        else:
            shards = self._replay[-a.preference_replay_k:] if a.preference_replay_mode == "nearest_k" else self._replay
            weights = lambda_decay_weights(len(shards), a.preference_replay_lambda) \
                if a.preference_replay_mode == "lambda_decay" else [1.0] * len(shards)
            size = a.preference_replay_sample_size or len(pairs) or next(
                (len(s) for _, s in reversed(self._replay) if len(s)), 0)
            rng = np.random.default_rng([a.seed, 19, number])
            chosen = [shards[s][1].pairs[i] for s, i in replay_draws([len(s) for _, s in shards], weights, size, rng)]
        self._log_distribution(chosen)
        self._iteration_metrics = {"iter/current_iteration": float(number), "iter/current_preference_pairs": float(len(pairs)),
                                   "iter/total_preference_pairs": float(sum(len(s) for _, s in self._replay)),
                                   "iter/train_preference_pairs": float(len(chosen))}
        return chosen

    def _pair_set_metrics(self) -> dict[str, float]:
        return dict(getattr(self, "_iteration_metrics", {}))

    # --- reward distributions -------------------------------------------------------------------------------
    def _distribution_range(self) -> tuple[float, float]:
        from ...utils.reward_utils import resolve_reward_range

        declared = resolve_reward_range(self.reward_func)
        if declared is None:
            raise ConfigError("log_reward_distribution=True needs reward_func.reward_range (minimum, maximum): "
                              "comlrl.utils.set_reward_range(reward_func, minimum, maximum).")
        low, high = declared
        if self.reward_processor is not None:  # the plotted rewards are processed ones
            low, high = sorted((float(self.reward_processor(low)), float(self.reward_processor(high))))
        return low, high

    def _log_distribution(self, chosen: list[PreferencePair]) -> None:
        if not self.args.log_reward_distribution or not self.dist.is_main:
            return
        low, high = self._distribution_range()
        series = {"candidate": self._distribution,
                  "selected": {"target": [p.target_raw_reward for p in chosen if p.target_raw_reward is not None],
                               "comparator": [p.comparator_raw_reward for p in chosen
                                              if p.comparator_raw_reward is not None]}}
        number = self._iteration + 1
        folder = self._folder(None, "reward_distributions")
        record = {"iteration": number, "reward_min": low, "reward_max": high, "num_bins": 16}
        for kind, sides in series.items():
            record[kind] = {}
            for side, values in sides.items():
                counts, edges = reward_histogram(values, low, high)
                record[kind][side] = {"sample_count": len(values), "counts": counts,
                                      "mean": float(np.mean(values)) if values else None}
            record["bin_edges"] = edges
        from ..._io import atomic_write_text

        atomic_write_text(folder / f"iteration_{number:04d}.json", json.dumps(record, indent=1))
        _plot_distribution(folder / f"iteration_{number:04d}.png", record)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for number, shard in self._replay:
            out.update(shard.to_tensors(f"replay{number}."))
        return out

    def _algorithm_state(self) -> dict[str, Any]:
        return {**super()._algorithm_state(), "iteration": self._iteration,
                "replay": [[number, len(shard)] for number, shard in self._replay]}

    def _load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        iteration, replay = state.get("iteration"), state.get("replay")
        if not isinstance(iteration, int) or not 0 <= iteration <= self.args.num_iterations or \
                not isinstance(replay, list):
            raise CheckpointError(f"this checkpoint's iteration cursor {state!r:.120} is malformed.")
        super()._load_algorithm_state(state, tensors)
        shards = []
        for entry in replay:
            if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, int) for v in entry)):
                raise CheckpointError(f"this checkpoint's replay record {entry!r:.80} is malformed.")
            try:
                shard = PairSet.from_tensors(tensors or {}, f"replay{entry[0]}.", decode=self._decode)
            except (KeyError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"this checkpoint's replay shard {entry[0]} is malformed ({exc}).") from None
            if len(shard) != entry[1]:
                raise CheckpointError(f"this checkpoint's replay shard {entry[0]} holds {len(shard)} pairs, not "
                                      f"{entry[1]}.")
            shards.append((entry[0], shard))
        self._iteration, self._replay = iteration, shards


class MADPOIterTrainer(_Iterative, MADPOTrainer):
    """Iterative MADPO: rounds of sampling, comparing against a comparator, and DPO.

    See the module docstring; arguments as :class:`MADPOTrainer` with a :class:`MADPOIterConfig`."""

    config_class = MADPOIterConfig
    default_config_cls = MADPOIterConfig
    algorithm_name = "MADPOIter"


class MARLHFIterTrainer(_Iterative, MARLHFTrainer):
    """Iterative MARLHF: rounds of sampling, comparing, reward-model training and online RL.

    See the module docstring; arguments as :class:`MARLHFTrainer` with a :class:`MARLHFIterConfig`."""

    config_class = MARLHFIterConfig
    default_config_cls = MARLHFIterConfig
    algorithm_name = "MARLHFIter"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._reward_initial = {k: v.detach().clone() for k, v in self.reward_model.state_dict().items()}
        self._reward_trained = False

    def _train_reward_model(self, loop: Any) -> None:
        """Every iteration starts from the reward model's initial weights and a fresh optimizer."""
        self.reward_model.load_state_dict(self._reward_initial)
        self.reward_optimizer.state.clear()
        super()._train_reward_model(loop)
        self._reward_trained = True

    def _rescore(self, ours: _Candidates, theirs: _Candidates, row: Any) -> None:
        if self.args.preference_scoring_reward != "reward_model" or not self._reward_trained:
            return
        from .marlhf import joint_reward_text

        prompts = [str(f(row)) for f in self.formatters]
        for side in (ours, theirs):
            texts = [joint_reward_text(prompts, answer) for answer in zip(*side.texts)]
            if texts:
                with torch.no_grad():
                    side.rewards = self._score(texts).tolist()

    def _algorithm_state(self) -> dict[str, Any]:
        return {**super()._algorithm_state(), "reward_trained": self._reward_trained}

    def _load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        super()._load_algorithm_state(state, tensors)
        self._reward_trained = bool(state.get("reward_trained", False))


def _plot_distribution(path: Path, record: dict[str, Any]) -> None:
    """Two histograms (all candidates; the pairs trained on) of the current policy's and the
    comparator's rewards, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = np.asarray(record["bin_edges"])
    centers, width = (edges[:-1] + edges[1:]) / 2, (edges[1] - edges[0]) * 0.4
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharex=True)
    for ax, kind, title in zip(axes, ("candidate", "selected"), ("Candidate rewards", "Rewards of the pairs trained on")):
        for offset, side, color in ((-width / 2, "target", "#e87030"), (width / 2, "comparator", "#6e6e6e")):
            entry = record[kind][side]
            ax.bar(centers + offset, entry["counts"], width=width, color=color,
                   label=f"{'current policy' if side == 'target' else 'comparator'} (n={entry['sample_count']})")
        ax.set_title(f"{title}, iteration {record['iteration']}", fontsize=10)
        ax.set_xlabel("reward")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("count")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
