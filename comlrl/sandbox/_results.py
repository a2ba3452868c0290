"""What the sandbox returns: plain frozen records."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExecResult", "TestResult", "TestReport", "RUN_STATUSES", "TEST_STATUSES"]

RUN_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
TEST_STATUSES = ("passed", "failed", "error", "timeout")


@dataclass(frozen=True)
class ExecResult:
    """One :meth:`Sandbox.run`.

    Attributes:
        status: ``"ok"`` (exit status 0), ``"error"`` (another exit status, e.g. an uncaught
            exception), ``"timeout"`` (wall-clock or CPU limit), ``"memory"`` (a MemoryError left the
            program), ``"output_limit"`` (stdout + stderr passed ``max_output_bytes``; the program was
            stopped) or ``"killed"`` (ended by a signal it did not get from the sandbox, e.g. a segfault).
        returncode: the exit status, ``-N`` for signal N, None when the sandbox stopped the program.
        stdout, stderr: what it wrote, together at most ``max_output_bytes`` (decoded as UTF-8).
        wall_s: seconds from the request to its end, sandbox overhead included.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class TestResult:
    """One test of a :meth:`Sandbox.check`: ``status`` is ``"passed"``, ``"failed"`` (an assertion
    failed), ``"error"`` (the program raised, exited, was killed, or failed to load) or
    ``"timeout"``; ``message`` says what happened (empty when passed)."""

    __test__ = False  # not a pytest class

    status: str
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class TestReport:
    """All tests of one :meth:`Sandbox.check`, in the order given."""

    __test__ = False

    results: tuple[TestResult, ...]
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        """How many tests passed."""
        return sum(r.passed for r in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def fraction(self) -> float:
        """passed / total (0.0 without tests)."""
        return self.passed / self.total if self.results else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.results) and self.passed == self.total

    def failures(self, limit: int | None = None) -> list[tuple[int, TestResult]]:
        """``(index, result)`` of the tests that did not pass, the first ``limit`` of them."""
        out = [(i, r) for i, r in enumerate(self.results) if not r.passed]
        return out if limit is None else out[:limit]
