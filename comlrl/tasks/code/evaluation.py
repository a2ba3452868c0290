"""pass@1 and pass@k of the code task, through the trainers' ``eval_logger`` / ``eval_aggregator``.

For pass@k with n samples per problem, evaluate on :func:`~comlrl.tasks.code.repeat_rows` of the
eval set (n copies of each row, sampled independently) and pass ``ks`` up to n: the aggregator
groups answers by ``task_id`` and uses the unbiased estimator of Chen et al. (2021),
``1 - C(n - c, k) / C(n, k)`` for c correct of n, averaged over problems.
"""

from __future__ import annotations

from math import comb
from typing import Any, Mapping, Optional, Sequence

from ...sandbox import Sandbox
from .program import joint_checks
from .prompts import HELPER_NAME

__all__ = ["pass_at_k", "CodeEvalLogger", "code_eval_logger", "pass_at_k_aggregator"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    return 1.0 - comb(n - c, k) / comb(n, k)


class CodeEvalLogger:
    """``eval_logger``: one record per eval item, ``{"task_id", "turn_t/passed", "turn_t/pass_rate"}``
    (passed: every test passed), all joint answers checked in one ``check_many``."""

    def __init__(self, sandbox: Sandbox, helper_name: str):
        self.sandbox, self.helper_name = sandbox, helper_name

    def __call__(self, agent_completions_turns: Sequence[Sequence[Sequence[str]]],
                 batch_items: Sequence[Mapping[str, Any]], prompts: Any = None, **_: Any) -> list[dict[str, Any]]:
        agents = len(agent_completions_turns)
        jobs, where = [], []
        for i, row in enumerate(batch_items):
            mains = agent_completions_turns[-1][i]
            helpers = agent_completions_turns[0][i] if agents > 1 else [""] * len(mains)
            jobs += [item for _, item in joint_checks(row, helpers, mains, self.helper_name)]
            where += [(i, t) for t in range(len(mains))]
        records: list[dict[str, Any]] = [{"task_id": str(row.get("task_id", i))} for i, row in enumerate(batch_items)]
        for (i, t), report in zip(where, self.sandbox.check_many(jobs)):
            records[i][f"turn_{t + 1}/passed"] = float(report.all_passed)
            records[i][f"turn_{t + 1}/pass_rate"] = report.fraction
        return records


def code_eval_logger(sandbox: Optional[Sandbox] = None, *, helper_name: str = HELPER_NAME,
                     timeout_s: float = 5.0) -> CodeEvalLogger:
    """The eval logger of the code task (see :class:`CodeEvalLogger`)."""
    return CodeEvalLogger(sandbox or Sandbox(timeout_s=timeout_s), helper_name)


def pass_at_k_aggregator(ks: Sequence[int] = (1,)):
    """``eval_aggregator``: ``pass@k`` for each k (of the last turn), ``turn_t/pass@1`` and
    ``turn_t/pass_rate`` per turn. A k above a problem's sample count is skipped for it."""
    ks = tuple(int(k) for k in ks)
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must hold integers >= 1, got {ks}.")

    def aggregate(records: Sequence[Mapping[str, Any]], num_turns: int = 1, **_: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        groups: dict[str, list[Mapping[str, Any]]] = {}
        for record in records:
            groups.setdefault(str(record["task_id"]), []).append(record)
        for t in range(1, num_turns + 1):
            key = f"turn_{t}/passed"
            per_task = [[r[key] for r in g if key in r] for g in groups.values()]
            per_task = [p for p in per_task if p]
            if not per_task:
                continue
            rates = [r[f"turn_{t}/pass_rate"] for g in groups.values() for r in g if key in r]
            out[f"turn_{t}/pass@1"] = sum(sum(p) / len(p) for p in per_task) / len(per_task)
            out[f"turn_{t}/pass_rate"] = sum(rates) / len(rates)
            if t == num_turns:
                for k in ks:
                    scores = [pass_at_k(len(p), int(sum(p)), k) for p in per_task if len(p) >= k]
                    if scores:
                        out[f"pass@{k}"] = sum(scores) / len(scores)
        return out

    aggregate.ks = ks  # plain data, part of the function's fingerprint through its closure
    return aggregate
