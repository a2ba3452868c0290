"""Evaluation, shared by every trainer family: one sampled completion per agent, prompt and turn,
from fixed per-prompt seeds, with every global random state restored afterwards (a run with
evaluation trains exactly as one without), and CoMLRL's task-metric callbacks.

``eval_logger`` gets, by keyword, those it declares (or, with ``**kwargs``, CoMLRL 1.4.3's three)
of: ``agent_completions_turns`` (``[agent][item][turn]``), ``batch_items`` and ``prompts`` (1.4.3's
form), ``test_cases`` and ``entry_points`` (each item's ``test`` / ``entry_point``: the form
loggers written for CoMLRL 1.3.9-1.4.2 take). ``eval_aggregator(metrics, num_turns=...)`` gets
``num_turns`` when it declares it (or ``**kwargs``), as 1.4.3 passes it; otherwise just the
metrics, as earlier CoMLRL versions called single-turn aggregators.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..exceptions import ConfigError
from . import distributed as dist
from .collect import eval_seeds
from .metrics import episode_metrics, merge_records, record_turns
from .prompts import PromptTable

__all__ = ["Evaluation", "EvalCallbacks", "restored_rng"]

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
        with restored_rng():
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

    def _eval_callbacks(self) -> "EvalCallbacks":
        """How to call the current ``eval_logger`` / ``eval_aggregator`` (planned again when the
        attributes were replaced after construction)."""
        held = (self.eval_logger, self.eval_aggregator)
        planned = getattr(self, "_eval_plan", None)
        if planned is None or planned[0][0] is not held[0] or planned[0][1] is not held[1]:
            self._eval_plan = (held, EvalCallbacks.plan(*held))
        return self._eval_plan[1]

    def _custom_eval_metrics(self, table: PromptTable, indices: list[int], completions) -> dict[str, float]:
        """``eval_logger`` / ``eval_aggregator`` (CoMLRL's task-metric callbacks), both or neither."""
        if self.eval_logger is None or self.eval_aggregator is None:
            return {}
        gathered = [c for part in dist.gather_objects(completions, self.dist) for c in part]
        by_index = dict(gathered)
        agents = len(next(iter(by_index.values()))) if by_index else self.num_agents
        per_agent = [[list(by_index[i][a]) for i in indices] for a in range(agents)]
        items = [table.item(i) for i in indices]
        aggregated = self._eval_callbacks().run(self.eval_logger, self.eval_aggregator, per_agent, items,
                                                self.args.num_turns)
        return {f"eval/{k}": float(v) for k, v in aggregated.items()}


@dataclass(frozen=True)
class EvalCallbacks:
    """How ``eval_logger`` and ``eval_aggregator`` are called, read once from their signatures
    (module docstring); :meth:`plan` refuses, when the trainer is built, a logger that cannot take
    ``agent_completions_turns`` or asks for something comlrl does not pass."""

    logger_keywords: frozenset = frozenset()
    aggregator_num_turns: bool = True

    LOGGER_VALUES = ("agent_completions_turns", "batch_items", "prompts", "test_cases", "entry_points")
    CURRENT = ("agent_completions_turns", "batch_items", "prompts")  # CoMLRL 1.4.3's call

    @classmethod
    def plan(cls, eval_logger: Optional[Callable], eval_aggregator: Optional[Callable]) -> "EvalCallbacks":
        for name, func in (("eval_logger", eval_logger), ("eval_aggregator", eval_aggregator)):
            if func is not None and not callable(func):
                raise ConfigError(f"{name} must be callable, got {type(func).__name__}.")
        return cls(cls._logger_keywords(eval_logger), cls._takes_num_turns(eval_aggregator))

    @classmethod
    def _logger_keywords(cls, func: Optional[Callable]) -> frozenset:
        params = _parameters(func)
        if func is None or params is None:
            return frozenset(cls.CURRENT)
        P = inspect.Parameter
        named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
        keywords = frozenset(n for n in cls.LOGGER_VALUES if n in named or (var_kw and n in cls.CURRENT))
        name = getattr(func, "__qualname__", type(func).__name__)
        if "agent_completions_turns" not in keywords:
            raise ConfigError(f"eval_logger {name} must take agent_completions_turns=... by keyword "
                              "([agent][item][turn] completions), as CoMLRL calls it: "
                              "eval_logger(agent_completions_turns=, batch_items=, prompts=) (1.4.3) or "
                              "eval_logger(agent_completions_turns, test_cases, entry_points, prompts) (1.4.2).")
        unknown = [p.name for p in params if p.default is P.empty and p.name not in keywords
                   and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
        if unknown:
            asked = ", ".join(map(repr, unknown))
            raise ConfigError(f"eval_logger {name} asks for {asked}, which comlrl does not pass; it passes "
                              f"{', '.join(cls.LOGGER_VALUES)} by keyword. Give it a default.")
        return keywords

    @staticmethod
    def _takes_num_turns(func: Optional[Callable]) -> bool:
        params = _parameters(func)
        if func is None or params is None:
            return True
        P = inspect.Parameter
        return any((p.name == "num_turns" and p.kind is not P.POSITIONAL_ONLY) or p.kind is P.VAR_KEYWORD
                   for p in params)

    def run(self, eval_logger: Callable, eval_aggregator: Callable, completions: list, items: list,
            num_turns: int) -> dict[str, Any]:
        """The aggregated task metrics of ``[agent][item][turn]`` eval completions of ``items``."""
        values = {"agent_completions_turns": completions, "batch_items": items,
                  "prompts": [row.get("prompt", "") for row in items],
                  "test_cases": [row.get("test", "") for row in items],
                  "entry_points": [row.get("entry_point", "") for row in items]}
        logged = eval_logger(**{k: v for k, v in values.items() if k in self.logger_keywords})
        if self.aggregator_num_turns:
            return eval_aggregator(logged, num_turns=num_turns) or {}
        return eval_aggregator(logged) or {}


def _parameters(func: Optional[Callable]) -> Optional[list[inspect.Parameter]]:
    if func is None:
        return None
    try:
        return list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def restored_rng():
    """Run a block without changing any global random state (evaluation never shifts training)."""
    from ..checkpoint.rng import capture_rng_state, restore_rng_state

    saved = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(*saved)


