"""Preference pairs: what a pair holds, how a pair set becomes tensors (checkpoints, replay
shards) and back, and how a batch of pairs is laid out for one padded forward pass."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..._io import atomic_write_text, temp_sibling
from ...rollout import Rollout, left_pad

__all__ = ["AgentPreferenceTensors", "PreferencePair", "PairSet", "pair_batch", "write_shard", "read_shard"]


@dataclass
class AgentPreferenceTensors:
    """One agent's token ids of a pair (1-D int64, no padding): its prompt, and its completions in
    the preferred and the other joint answer (up to and including EOS)."""

    prompt_input_ids: torch.Tensor
    winner_completion_ids: torch.Tensor
    loser_completion_ids: torch.Tensor


@dataclass
class PreferencePair:
    """Two joint answers to one prompt, the first preferred (CoMLRL 1.4.3's fields).

    ``winner_reward`` / ``loser_reward`` are the processed rewards that decided; ``raw_rewards``,
    ``target_raw_reward`` and ``comparator_raw_reward`` (iterative variants) the rewards before
    ``reward_processor`` of [winner, loser], of the current policy's side and of the comparator's.
    """

    prompts: list[str]
    winner_completions: list[str]
    loser_completions: list[str]
    agent_tensors: list[AgentPreferenceTensors]
    winner_reward: float
    loser_reward: float
    candidate_reward_mean: float
    raw_rewards: Optional[list[float]] = None
    target_raw_reward: Optional[float] = None
    comparator_raw_reward: Optional[float] = None
    item_index: int = -1                      # the dataset row (comlrl)
    metadata: dict[str, Any] = field(default_factory=dict)


_NUMBERS = ("winner_reward", "loser_reward", "candidate_reward_mean", "target_raw_reward", "comparator_raw_reward")


def _flat(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(p) for p in parts], dtype=torch.long)
    values = torch.cat([p.to(torch.long).reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
    return values, lengths


def _unflat(values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(values, lengths.tolist())) if len(lengths) else []


class PairSet:
    """The pairs one iteration trains on, with each agent's reference log-probabilities of them
    (``ref [P, N, 2]``: winner, loser; computed once when the set is made)."""

    def __init__(self, pairs: list[PreferencePair], ref: Optional[torch.Tensor] = None):
        self.pairs, self.ref = pairs, ref

    def __len__(self) -> int:
        return len(self.pairs)

    # --- tensors (checkpoints and shards) -----------------------------------------------------------
    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every id and number of the set as named tensors (texts are not kept: they are decoded
        back from the ids when needed)."""
        out: dict[str, torch.Tensor] = {}
        agents = len(self.pairs[0].agent_tensors) if self.pairs else 0
        for a in range(agents):
            for name in ("prompt_input_ids", "winner_completion_ids", "loser_completion_ids"):
                values, lengths = _flat([getattr(p.agent_tensors[a], name) for p in self.pairs])
                out[f"{prefix}agent{a}.{name}"], out[f"{prefix}agent{a}.{name}.lengths"] = values, lengths
        numbers = [[math.nan if getattr(p, k) is None else float(getattr(p, k)) for k in _NUMBERS]
                   + [float(p.item_index)] for p in self.pairs]
        out[f"{prefix}numbers"] = torch.tensor(numbers, dtype=torch.float64).reshape(len(self.pairs), len(_NUMBERS) + 1)
        if self.ref is not None:
            out[f"{prefix}ref"] = self.ref.to(torch.float64)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "", decode=None) -> "PairSet":
        """The set :meth:`to_tensors` wrote; ``decode(agent, ids) -> str`` rebuilds the texts."""
        numbers = tensors[f"{prefix}numbers"]
        count = numbers.shape[0]
        agents = sum(1 for k in tensors if k.startswith(f"{prefix}agent") and k.endswith(".prompt_input_ids"))
        columns = {}
        for a in range(agents):
            for name in ("prompt_input_ids", "winner_completion_ids", "loser_completion_ids"):
                columns[a, name] = _unflat(tensors[f"{prefix}agent{a}.{name}"],
                                           tensors[f"{prefix}agent{a}.{name}.lengths"])
                if len(columns[a, name]) != count:
                    raise ValueError(f"pair tensors disagree: {count} pairs but {len(columns[a, name])} {name}")
        pairs = []
        for i in range(count):
            row = numbers[i].tolist()
            values = {k: (None if math.isnan(v) else v) for k, v in zip(_NUMBERS, row)}
            agent_tensors = [AgentPreferenceTensors(columns[a, "prompt_input_ids"][i].clone(),
                                                    columns[a, "winner_completion_ids"][i].clone(),
                                                    columns[a, "loser_completion_ids"][i].clone())
                             for a in range(agents)]
            text = (lambda a, ids: decode(a, ids)) if decode is not None else (lambda a, ids: "")
            raw = [values["target_raw_reward"], values["comparator_raw_reward"]]
            pairs.append(PreferencePair(
                prompts=[text(a, t.prompt_input_ids) for a, t in enumerate(agent_tensors)],
                winner_completions=[text(a, t.winner_completion_ids) for a, t in enumerate(agent_tensors)],
                loser_completions=[text(a, t.loser_completion_ids) for a, t in enumerate(agent_tensors)],
                agent_tensors=agent_tensors, winner_reward=values["winner_reward"], loser_reward=values["loser_reward"],
                candidate_reward_mean=values["candidate_reward_mean"],
                raw_rewards=None if raw[0] is None else raw, target_raw_reward=values["target_raw_reward"],
                comparator_raw_reward=values["comparator_raw_reward"], item_index=int(row[-1])))
        ref = tensors.get(f"{prefix}ref")
        return cls(pairs, ref.clone() if ref is not None else None)


def pair_batch(pairs: Sequence[PreferencePair], agent: int, pad_token_id: int) -> Rollout:
    """Agent ``agent``'s winners then losers of ``pairs`` as one batch of ``2P`` rows: prompts
    left-padded, completions right-padded (every real completion token scored)."""
    prompts = [p.agent_tensors[agent].prompt_input_ids.tolist() for p in pairs] * 2
    completions = ([p.agent_tensors[agent].winner_completion_ids.tolist() for p in pairs]
                   + [p.agent_tensors[agent].loser_completion_ids.tolist() for p in pairs])
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(max((len(c) for c in completions), default=1), 1)
    completion_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for row, ids in enumerate(completions):
        completion_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[row, :len(ids)] = True
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask,
                   torch.arange(len(completions)) % max(len(pairs), 1), [""] * len(completions))


# --- replay shards: <dir>/iteration_NNNN.jsonl (texts, rewards) + .safetensors (ids) ---------------

def write_shard(directory: Path, iteration: int, pair_set: PairSet) -> tuple[Path, Path]:
    """Write iteration ``iteration``'s pairs (1-based) atomically: JSONL for reading, safetensors
    for training; each file appears whole or not at all."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    stem = f"iteration_{iteration:04d}"
    lines = [json.dumps({"iteration": iteration, "prompts": p.prompts, "winner_completions": p.winner_completions,
                         "loser_completions": p.loser_completions, "winner_reward": p.winner_reward,
                         "loser_reward": p.loser_reward, "candidate_reward_mean": p.candidate_reward_mean,
                         "raw_rewards": p.raw_rewards or [], "target_raw_reward": p.target_raw_reward,
                         "comparator_raw_reward": p.comparator_raw_reward, "item_index": p.item_index},
                        ensure_ascii=False, allow_nan=False) for p in pair_set.pairs]
    paths = (directory / f"{stem}.jsonl", directory / f"{stem}.safetensors")
    tmp = temp_sibling(paths[1])  # created exclusively: nothing planted at a guessable name is written through
    try:
        save_file(pair_set.to_tensors(), str(tmp))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, paths[1])
    finally:
        if tmp.exists():
            tmp.unlink()
    atomic_write_text(paths[0], "".join(line + "\n" for line in lines))  # fsyncs the directory too
    return paths


def read_shard(path: Path, decode=None) -> PairSet:
    """A shard written by :func:`write_shard` (its ``.safetensors`` file)."""
    from safetensors.torch import load_file

    return PairSet.from_tensors(load_file(str(path)), decode=decode)
