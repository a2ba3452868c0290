"""Rewards of the code task, run through :mod:`comlrl.sandbox`.

Code-collaboration reward (CoMLRL's semantics, values below; maximum 4.0). Agent 1 writes the
helper ``aux``, agent 2 the entry-point function (``main``); the joint program is the prompt's
imports and helpers, then ``aux``, then ``main``:

    level 1  +0.4  aux is defined and returns a value (optional: missing only forgoes this)
             +0.6  main is defined and returns a value        (missing: stop here)
    level 2  +0.5  the joint program parses                    (not: stop here)
    level 3  +1.0 x the fraction of the task's tests that pass (each test judged on its own)
             with at least one test passed, aux defined and main calling aux:
             +0.5  main calls aux
             +1.0  main is not a mere wrapper (``return aux(...)``, ``r = aux(...); return r``)
             -0.5  main calls aux without using the result (a bare ``aux(...)`` statement)

All joint answers of one reward call are checked in one ``Sandbox.check_many`` (identical programs
once). The reward objects hold their settings as plain attributes, so a checkpoint's reward
fingerprint is the same in every process for the same settings (and a resumed run is accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ...sandbox import Sandbox, TestReport
from .program import Structure, joint_checks, structure
from .prompts import HELPER_NAME

__all__ = ["CollabLevels", "code_collab_reward", "pass_rate_reward", "CodeCollabReward", "PassRateReward",
           "score_collab"]


@dataclass(frozen=True)
class CollabLevels:
    """The values of :func:`code_collab_reward` (CoMLRL's by default)."""

    helper_defined: float = 0.4
    main_defined: float = 0.6
    parses: float = 0.5
    tests: float = 1.0            # times the fraction of tests passed
    calls_helper: float = 0.5
    not_wrapper: float = 1.0
    ignored_result: float = -0.5

    @property
    def maximum(self) -> float:
        return self.helper_defined + self.main_defined + self.parses + self.tests + self.calls_helper + self.not_wrapper


def score_collab(s: Structure, report: Optional[TestReport], levels: CollabLevels = CollabLevels()) -> float:
    """The reward of one joint answer from its structure and test report (None: not run)."""
    reward = levels.helper_defined if s.helper_defined else 0.0
    if not s.main_defined:
        return reward
    reward += levels.main_defined
    if not s.parses:
        return reward
    reward += levels.parses
    if report is None or not report.total:
        return reward
    reward += levels.tests * report.fraction
    if report.passed and s.helper_defined and s.calls_helper:
        reward += levels.calls_helper
        reward += levels.not_wrapper if s.not_wrapper else 0.0
        reward += levels.ignored_result if not s.uses_result else 0.0
    return reward


def _row(batch_items: Optional[Sequence[Mapping[str, Any]]], who: str) -> Mapping[str, Any]:
    if not batch_items:
        raise ValueError(f"{who} needs the task's row (prompt, entry_point, test): the trainer passes it as "
                         "batch_items=[row]; called directly, pass batch_items=[row].")
    row = batch_items[0]
    missing = [k for k in ("prompt", "entry_point", "test") if k not in row]
    if missing:
        raise ValueError(f"{who}: the dataset row lacks {missing}; use comlrl.tasks.code.load_humaneval() or rows "
                         "with these columns.")
    return row


class CodeCollabReward:
    """``reward(helpers, mains, *, batch_items)`` -> one float per joint answer (module docstring).

    Build it with :func:`code_collab_reward`. Each call scores one task item's joint answers, which
    the trainer passes with the item's row as ``batch_items=[row]``.
    """

    reward_batched = True  # one call per task item: its programs are checked in one sandbox batch

    def __init__(self, sandbox: Sandbox, levels: CollabLevels, helper_name: str):
        self.sandbox = sandbox
        self.levels = tuple(vars(levels).items())  # plain data: part of the reward's fingerprint
        self.helper_name = helper_name

    def __call__(self, completions1: Sequence[str], completions2: Sequence[str], *,
                 batch_items: Optional[Sequence[Mapping[str, Any]]] = None) -> list[float]:
        row = _row(batch_items, "code_collab_reward")
        entry = str(row["entry_point"])
        checks = joint_checks(row, completions1, completions2, self.helper_name)
        shapes = [structure(h, m, entry, program, self.helper_name)
                  for h, m, (program, _) in zip(completions1, completions2, checks)]
        runnable = [i for i, s in enumerate(shapes) if s.main_defined and s.parses]
        reports = dict(zip(runnable, self.sandbox.check_many([checks[i][1] for i in runnable])))
        levels = CollabLevels(**dict(self.levels))
        return [score_collab(s, reports.get(i), levels) for i, s in enumerate(shapes)]


class PassRateReward:
    """``reward(mains, *, batch_items)`` or ``reward(helpers, mains, *, batch_items)``: the fraction
    of the task's tests the program passes (one agent's function, or the joint program)."""

    reward_batched = True  # one call per task item: its programs are checked in one sandbox batch

    def __init__(self, sandbox: Sandbox, helper_name: str):
        self.sandbox, self.helper_name = sandbox, helper_name

    def __call__(self, *completions: Sequence[str], batch_items: Optional[Sequence[Mapping[str, Any]]] = None,
                 **_: Any) -> list[float]:  # **_: comlrl passes batch_items to *args rewards only with **kwargs
        row = _row(batch_items, "pass_rate_reward")
        if len(completions) not in (1, 2):
            raise ValueError(f"pass_rate_reward scores one agent (the function) or two (helper, function); got "
                             f"{len(completions)} completion lists.")
        mains = completions[-1]
        helpers = completions[0] if len(completions) == 2 else [""] * len(mains)
        items = [item for _, item in joint_checks(row, helpers, mains, self.helper_name)]
        return [r.fraction for r in self.sandbox.check_many(items)]


def code_collab_reward(sandbox: Optional[Sandbox] = None, *, levels: Optional[CollabLevels] = None,
                       helper_name: str = HELPER_NAME, timeout_s: float = 5.0) -> CodeCollabReward:
    """The code-collaboration reward (values in the module docstring), run in ``sandbox`` (default:
    ``Sandbox(timeout_s=timeout_s)``). ``levels`` changes the values."""
    return CodeCollabReward(sandbox or Sandbox(timeout_s=timeout_s), levels or CollabLevels(), helper_name)


def pass_rate_reward(sandbox: Optional[Sandbox] = None, *, helper_name: str = HELPER_NAME,
                     timeout_s: float = 5.0) -> PassRateReward:
    """The fraction of tests passed, for one agent or the joint program (see :class:`PassRateReward`)."""
    return PassRateReward(sandbox or Sandbox(timeout_s=timeout_s), helper_name)
