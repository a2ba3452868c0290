"""Evaluation, shared by every trainer family: one sampled completion per agent, prompt and turn,
from fixed per-prompt seeds, with every global random state restored afterwards (a run with
evaluation trains exactly as one without), and CoMLRL's task-metric callbacks."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

from . import distributed as dist
from .collect import eval_seeds
from .metrics import episode_metrics, merge_records, record_turns
from .prompts import PromptTable

__all__ = ["Evaluation"]

logger = logging.getLogger("comlrl")


class Evaluation:
    """``evaluate()`` of :class:`comlrl.engine.trainer.Trainer`."""

    def evaluate(self, num_eval_samples: Optional[int] = None) -> dict[str, float]:
        """Sample one completion per agent and turn for the first eval prompts and score them.

        Uses the first ``num_eval_samples`` rows of ``eval_dataset`` (default ``eval_num_samples``;
        0 or None = all). Every turn is played (no early termination). Eval samples come from their
        own seeds, the same at every evaluation, and every global random state is restored
        afterwards, so a run with evaluation trains exactly as one without. Under torchrun every
        process must call it. Returns ``{}`` without an eval_dataset.

        Returns:
            ``eval/turn_{t}/reward_mean``, ``eval/turn_{t}/expected_return``, ``eval/reward_mean``,
            ``eval/reward_std``, ``eval/return_mean``, ``eval/agent_{a}/completion_length``, and
            ``eval/<key>`` for what ``eval_aggregator`` returns.
        """
        if self.eval_dataset is None:
            logger.warning("comlrl: evaluate() without an eval_dataset returns nothing; pass eval_dataset=...")
            return {}
        self._check_open()
        self._check_ready()
        table = self._table("eval")
        count = num_eval_samples if num_eval_samples is not None else self.args.eval_num_samples
        indices = list(range(len(table) if not count else min(count, len(table))))
        with _restored_rng():
            records, completions = self._eval_episodes(table, indices)
        merged = merge_records(records, self.args.num_turns, self.num_agents, self.dist)
        metrics = {k: v for k, v in episode_metrics(merged, "eval", "eval/").items()
                   if not k.endswith(("reward_min", "reward_max", "completion_length_max"))}
        metrics.update(self._custom_eval_metrics(table, indices, completions))
        return metrics

    def _eval_episodes(self, table: PromptTable, indices: list[int]):
        collector = self._collector(table)
        records, completions = [], []
        with self._sampling():  # sharded agents gathered on every process, with eval prompts or without
            self._play_eval(collector, table, indices, records, completions)
        return records, completions

    def _play_eval(self, collector: Any, table: PromptTable, indices: list[int], records: list, completions: list
                   ) -> None:
        """Every eval batch of this process: its episodes' records and completions, appended."""
        from ..functional.returns import discounted_returns

        for start in range(0, len(indices), self.args.eval_batch_size):
            mine = dist.shard(indices[start:start + self.args.eval_batch_size], self.dist)
            if not mine:
                continue
            turns = collector.play(self._batch(table, mine), num_generations=1, num_turns=self.args.num_turns,
                                   seed_of=eval_seeds(self.args.seed), threshold=None)
            returns = discounted_returns([t.rewards for t in turns], [t.children for t in turns], 1,
                                         self.args.discount, self.args.num_turns)
            records.append(record_turns(turns, returns))
            completions.extend((idx, self._eval_completions(turns, g)) for g, idx in enumerate(mine))

    def _eval_completions(self, turns, group: int) -> list[list[str]]:
        """``[agent][turn]`` completions of eval item ``group`` (one sample per turn), as
        ``eval_logger`` sees them."""
        return [[t.completions[a][group] for t in turns] for a in range(len(turns[0].completions))]

    def _custom_eval_metrics(self, table: PromptTable, indices: list[int], completions) -> dict[str, float]:
        """``eval_logger`` / ``eval_aggregator`` (CoMLRL's task-metric callbacks), both or neither."""
        if self.eval_logger is None or self.eval_aggregator is None:
            return {}
        gathered = [c for part in dist.gather_objects(completions, self.dist) for c in part]
        by_index = dict(gathered)
        agents = len(next(iter(by_index.values()))) if by_index else self.num_agents
        per_agent = [[list(by_index[i][a]) for i in indices] for a in range(agents)]
        items = [table.item(i) for i in indices]
        logged = self.eval_logger(agent_completions_turns=per_agent, batch_items=items,
                                  prompts=[row.get("prompt") for row in items])
        aggregated = self.eval_aggregator(logged, num_turns=self.args.num_turns) or {}
        return {f"eval/{k}": float(v) for k, v in aggregated.items()}


@contextlib.contextmanager
def _restored_rng():
    """Run a block without changing any global random state (evaluation never shifts training)."""
    from ..checkpoint.rng import capture_rng_state, restore_rng_state

    saved = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(*saved)


