"""Multi-turn: each agent's next prompt carries what went wrong (CoMLRL's feedback mode)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ...sandbox import Sandbox
from .program import joint_checks, structure
from .prompts import HELPER_NAME

__all__ = ["TestFeedback", "test_feedback_transition"]


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


class TestFeedback:
    """``external_transition`` for ``num_turns > 1``: runs the joint answer's tests and returns,
    for each agent, the problem, its own previous code, the teammate's, the structure checks and
    the first ``max_failures`` failing tests with their messages (build with
    :func:`test_feedback_transition`). One agent: only the function's part."""

    __test__ = False  # not a pytest class

    def __init__(self, sandbox: Sandbox, max_failures: int, helper_name: str):
        self.sandbox, self.max_failures, self.helper_name = sandbox, max_failures, helper_name

    def __call__(self, agent_completions: Sequence[str], num_agents: int = 2,
                 batch_item: Optional[Mapping[str, Any]] = None, **_: Any) -> list[str]:
        if batch_item is None:
            raise ValueError("test_feedback_transition needs the task's row (batch_item=...), which comlrl passes.")
        prompt, entry = str(batch_item["prompt"]), str(batch_item["entry_point"])
        main = agent_completions[-1]
        helper = agent_completions[0] if num_agents > 1 else ""
        [(program, item)] = joint_checks(batch_item, [helper], [main], self.helper_name)
        shape = structure(helper, main, entry, program, self.helper_name)
        report = self.sandbox.check(*item)
        lines = [f"- {entry} defined and returning: {_mark(shape.main_defined)}",
                 f"- the program parses: {_mark(shape.parses)}",
                 f"- tests passed: {report.passed}/{report.total}"]
        for index, result in report.failures(self.max_failures):
            lines.append(f"  test {index + 1} {result.status}: {result.message[:400]}")
        if num_agents == 1:
            return [self._prompt(prompt, entry, main, None, lines, f"def {entry}(...)")]
        lines.insert(0, f"- {self.helper_name} defined and returning: {_mark(shape.helper_defined)}")
        lines.append(f"- {entry} calls {self.helper_name}: {_mark(shape.calls_helper)}"
                     + ("" if shape.uses_result else " (but ignores its result)"))
        return [self._prompt(prompt, entry, helper, main, lines, f"def {self.helper_name}(...)"),
                self._prompt(prompt, entry, main, helper, lines, f"def {entry}(...)")] + \
            [self._prompt(prompt, entry, main, helper, lines, f"def {entry}(...)")] * (num_agents - 2)

    @staticmethod
    def _prompt(problem: str, entry: str, mine: str, theirs: Optional[str], lines: list[str], target: str) -> str:
        parts = [f"Problem:\n{problem}", f"Your previous code:\n{mine.strip() or '(empty)'}"]
        if theirs is not None:
            parts.append(f"Your teammate's code:\n{theirs.strip() or '(empty)'}")
        parts.append("What happened:\n" + "\n".join(lines))
        parts.append(f"Write `{target}` again, fixed. Answer with the code only.")
        return "\n\n".join(parts) + "\n"


def test_feedback_transition(sandbox: Optional[Sandbox] = None, *, max_failures: int = 3,
                             helper_name: str = HELPER_NAME, timeout_s: float = 5.0) -> TestFeedback:
    """The test-feedback transition (see :class:`TestFeedback`); ``max_failures`` failing tests
    are quoted. Use with ``MAGRPOConfig(num_turns=2, ...)``."""
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0, got {max_failures}.")
    return TestFeedback(sandbox or Sandbox(timeout_s=timeout_s), max_failures, helper_name)


test_feedback_transition.__test__ = False  # a factory, not a pytest test
