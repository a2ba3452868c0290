"""Iterative MADPO and MARLHF: several rounds of generate, compare, train.

Each iteration:

    snapshot   the agents as they start the iteration, when policy_checkpoint_dir is set or the
               comparator is 'history' (transformers folders, policy_checkpoints/run-<id>/iteration_NNNN,
               bound to the run: the sha256 of every file is kept in the checkpoints, and a snapshot
               that another run wrote or that changed since is refused, never compared against)
    pairs      the current policy's candidates against the comparator's candidates of the same
               index (comparators: comlrl.trainers.preference.comparators), both scored by the task
               reward (MARLHFIter may score with its previous reward model), pairs by pair_selection
    replay     this iteration's pairs are written as a shard (JSONL + safetensors); the pairs trained
               on come from the newest shard ('current'), the newest k, all, or a lambda-decayed
               mix of them; optional reward-distribution plots (matplotlib PNG + JSON)
    train      MADPOIter: num_train_epochs of DPO (reference: the policy starting the iteration);
               MARLHFIter: a fresh reward model on the pairs, then num_train_epochs of the online phase

Checkpoints hold every shard, so a resume needs nothing outside the checkpoint but the policy
snapshots of the 'history' comparator, which it verifies against the hashes the checkpoint holds.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ...engine import distributed as dist
from ...engine.schedule import TrainingLoop
from ...engine.streams import Stream, stream_rng
from ...engine.timing import PhaseTimer
from ..._imports import install_hint
from ..._io import own_dir, refuse_link, temp_sibling
from ...checkpoint.files import tree_hashes
from ...exceptions import CheckpointDirError, CheckpointError, ConfigError
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
                raise ConfigError(f"log_reward_distribution=True draws with matplotlib: {install_hint('plot')}.")
        uses_history = a.comparator_policy == "history" or a.policy_checkpoint_dir is not None
        from ...adapters import AdapterAgent

        if a.comparator_policy == "history" and any(isinstance(p, AdapterAgent) for p in self._policies()):
            raise ConfigError("comparator_policy='history' with LoRA agents is not supported yet; use 'current', "
                              "'model' or 'api'.")
        self._snapshots = uses_history
        self._snapshot_files: dict[int, dict[str, str]] = {}  # iteration -> {file: sha256} of its snapshot
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

    def _check_training_inputs(self) -> None:
        super()._check_training_inputs()
        if self._api is not None:  # the key is needed to train, not to build the trainer (export)
            self._api.check_key()

    # --- output folders (beside the metrics) ---------------------------------------------------------
    def _folder(self, configured: Optional[str], name: str) -> Path:
        """A configured folder (the user's choice, wherever it points), else ``name`` beside the
        metrics, which is never a symbolic link (written through, it would overwrite elsewhere)."""
        if configured:
            return Path(configured)
        folder = (self._root or self.outputs_dir) / name
        refuse_link(folder, f"the {name} folder", CheckpointDirError)
        return folder

    def _comparator_devices(self) -> list[Any]:
        from ...engine.devices import DeviceScheduler

        if self.args.comparator_devices is None:
            return list(self.agent_devices)
        return DeviceScheduler.resolve_devices(self.args.comparator_devices, self.num_agents, kind="comparator_devices")

    # --- the schedule -----------------------------------------------------------------------------------
    def is_complete(self) -> bool:
        return self._iteration >= self.args.num_iterations

    def run_schedule(self, loop: TrainingLoop, progress: Any) -> None:
        self._root = self.legacy_outputs_dir() or loop.checkpoint_dir or self.outputs_dir
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

    def epoch_position(self, epoch: float) -> float:
        """Rows count epochs over the whole run: iteration i's epoch e is i * num_train_epochs + e."""
        return self._iteration * self.args.num_train_epochs + epoch

    # --- snapshots of the policy (history comparator, policy_checkpoint_dir) ----------------------------
    def _snapshot_dir(self, iteration: int) -> Path:
        """This run's snapshot of ``iteration``: a folder of its own per run (``run-<first 8 hex
        digits of the run id>``), so that runs sharing an output_dir never overwrite each other's."""
        root = self._folder(self.args.policy_checkpoint_dir, "policy_checkpoints")
        return root / f"run-{self.run_id[:8]}" / f"iteration_{iteration:04d}"

    def _save_snapshot(self) -> None:
        if not self._snapshots:
            return
        target = self._snapshot_dir(self._iteration)
        self._snapshot_files[self._iteration] = dist.main_process_first_result(
            lambda: self._write_snapshot(target), self.dist)

    def _write_snapshot(self, target: Path) -> dict[str, str]:
        """Write the snapshot (replacing only one this run wrote) and return its files' hashes."""
        from ...checkpoint.export import export_record
        from ...engine.persistence import write_agents

        record = export_record(target) if target.is_dir() else None
        if record is not None and record["run_id"] != self.run_id:
            raise CheckpointError(f"{target} holds another run's policy snapshot (run {record['run_id']}); it is never "
                                  "replaced. Set policy_checkpoint_dir to another folder.")
        own_dir(target.parent, "the policy snapshot folder", CheckpointDirError)
        write_agents(target, self._exported(), False, self.run_id)
        return tree_hashes(target)

    def _history_models(self) -> tuple[list[Any], list[Any]]:
        """The agents as they started iteration ``max(0, i - comparator_history_k)``, from the
        snapshot this run wrote then, checked file by file against the hashes it kept."""
        from transformers import AutoModelForCausalLM

        iteration = max(0, self._iteration - (self.args.comparator_history_k or 1))
        source = self._snapshot_dir(iteration)
        self._check_snapshot(iteration, source)
        models = []
        for a, device in enumerate(self.agent_devices):
            models.append(AutoModelForCausalLM.from_pretrained(source / f"agent_{a}").to(device).eval()
                          .requires_grad_(False))
        return models, list(self.tokenizers)

    def _check_snapshot(self, iteration: int, source: Path) -> None:
        expected = self._snapshot_files.get(iteration)
        if expected is None:
            raise CheckpointError(f"comparator_policy='history' needs this run's policy snapshot of iteration "
                                  f"{iteration}, of which the run holds no record; resume from a checkpoint written "
                                  "after it.")
        if not source.is_dir() or source.is_symlink():
            raise CheckpointError(f"comparator_policy='history' needs the saved policy {source}, which is missing; "
                                  "keep policy_checkpoint_dir with the run's checkpoints.")
        found = tree_hashes(source)
        changed = sorted(set(found) ^ set(expected) | {f for f in found if found[f] != expected.get(f)})
        if changed:
            raise CheckpointError(f"the policy snapshot {source} is not the one this run saved (written by another run, "
                                  f"or changed since: {', '.join(changed[:4])}); comparing against it would train on "
                                  "wrong weights. Restore it, or start the run again.")

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
                clipped = [[self._clipped(text, a) for text in t[:width]] for a, t in enumerate(texts)]
                texts = [[text for text, _ in agent] for agent in clipped]
                rewards = self.reward(texts, batch.prompts[0][g], row).tolist() if width else []
                out.append(_Candidates(texts, [[ids for _, ids in agent] for agent in clipped], rewards))
        return out

    def _clipped(self, text: str, agent: int) -> tuple[str, torch.Tensor]:
        """An API completion as the agent's own would be: at most ``max_new_tokens`` tokens of its
        tokenizer (an endpoint may ignore the limit), ending with EOS unless cut short."""
        tokenizer, limit = self.tokenizers[agent], self.args.max_new_tokens
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= limit:
            ids = ids[:limit]
            text = tokenizer.decode(ids)
        else:
            ids = ids + [tokenizer.eos_token_id]
        return text, torch.tensor(ids, dtype=torch.long)

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
        rng = stream_rng(a.seed, Stream.PREFERENCE_PAIRS, self._set_id, index)
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
            rng = stream_rng(a.seed, Stream.REPLAY, number)
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

    def algorithm_state(self) -> dict[str, Any]:
        return {**super().algorithm_state(), "iteration": self._iteration,
                "replay": [[number, len(shard)] for number, shard in self._replay],
                "snapshots": {str(i): dict(files) for i, files in sorted(self._snapshot_files.items())}}

    def load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        iteration, replay = state.get("iteration"), state.get("replay")
        if not isinstance(iteration, int) or not 0 <= iteration <= self.args.num_iterations or \
                not isinstance(replay, list):
            raise CheckpointError(f"this checkpoint's iteration cursor {state!r:.120} is malformed.")
        super().load_algorithm_state(state, tensors)
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
        self._snapshot_files = _snapshot_records(state.get("snapshots", {}), iteration)


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

    def _train_reward_model(self, loop: TrainingLoop) -> None:
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

    def algorithm_state(self) -> dict[str, Any]:
        return {**super().algorithm_state(), "reward_trained": self._reward_trained}

    def load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        super().load_algorithm_state(state, tensors)
        self._reward_trained = bool(state.get("reward_trained", False))


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _snapshot_records(value: Any, iteration: int) -> dict[int, dict[str, str]]:
    """The checkpoint's record of the policy snapshots (``{"<iteration>": {file: sha256}}``),
    checked: iterations up to the current one, relative file names, sha256 digests."""
    def ok_files(files: Any) -> bool:
        return isinstance(files, dict) and all(
            isinstance(k, str) and k and not k.startswith("/") and ".." not in Path(k).parts
            and isinstance(v, str) and _SHA256.match(v) for k, v in files.items())

    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdigit() and int(k) <= iteration
                                              and ok_files(v) for k, v in value.items()):
        raise CheckpointError(f"this checkpoint's policy snapshot record {value!r:.120} is malformed.")
    return {int(k): dict(v) for k, v in value.items()}


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
    tmp = temp_sibling(path, suffix=".png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


def __getattr__(name: str) -> Any:
    """``wandb`` is a module global of CoMLRL 1.4.3's iterative module (scripts patch it); importing
    it costs seconds, so it is imported when first looked up, not with the trainers."""
    if name == "wandb":
        import wandb

        globals()["wandb"] = wandb
        return wandb
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
