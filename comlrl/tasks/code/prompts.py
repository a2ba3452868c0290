"""Prompts of the two roles of code collaboration, and of one agent writing alone (GRPO baseline).

Formatter convention (comlrl's and CoMLRL's): ``f(row, external_prompts=None) -> str``. On a later
turn ``external_prompts`` is the prompt :func:`~comlrl.tasks.code.test_feedback_transition` wrote
for this agent (problem, code so far, failing tests); it is used as it is.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

__all__ = ["helper_formatter", "main_formatter", "single_formatter", "HELPER_NAME"]

HELPER_NAME = "aux"


def _signature(row: Mapping[str, Any]) -> str:
    match = re.search(rf"def\s+{re.escape(str(row['entry_point']))}\s*\(([^)]*)\)", str(row["prompt"]))
    return f"{row['entry_point']}({match.group(1) if match else '...'})"


def helper_formatter(row: Mapping[str, Any], external_prompts: Optional[str] = None) -> str:
    """Agent 1: write ``aux``, a helper the main function can call."""
    if external_prompts is not None:
        return external_prompts
    return (f"You and a teammate solve this Python problem together. Your teammate writes "
            f"{_signature(row)}; you write one helper function named `{HELPER_NAME}` that it can call "
            "for part of the work.\n\n"
            f"Problem:\n{row['prompt']}\n"
            f"Answer with the code of `def {HELPER_NAME}(...)` only: no explanation, no tests, no examples. "
            f"It must return its result.\n")


def main_formatter(row: Mapping[str, Any], external_prompts: Optional[str] = None) -> str:
    """Agent 2: write the entry-point function, which may call the teammate's ``aux``."""
    if external_prompts is not None:
        return external_prompts
    return (f"You and a teammate solve this Python problem together. Your teammate writes a helper "
            f"function `{HELPER_NAME}(...)` that you may call; you write {_signature(row)}.\n\n"
            f"Problem:\n{row['prompt']}\n"
            f"Answer with the code of `def {row['entry_point']}(...)` only, using `{HELPER_NAME}` where it helps: "
            "no explanation, no tests, no examples.\n")


def single_formatter(row: Mapping[str, Any], external_prompts: Optional[str] = None) -> str:
    """One agent writes the whole function (the GRPO baseline)."""
    if external_prompts is not None:
        return external_prompts
    return (f"Solve this Python problem.\n\nProblem:\n{row['prompt']}\n"
            f"Answer with the code of `def {row['entry_point']}(...)` only: no explanation, no tests, no examples.\n")
