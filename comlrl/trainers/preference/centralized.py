"""Centralised collaboration: ONE policy writes every role's part in one completion.

An adapter builds the joint prompt from the roles' own prompts and splits a joint completion back
into one output per role, so that the task's reward (and metrics) see the roles separately while
the policy learns from the joint text. :class:`TaggedCentralizedComparatorAdapter` asks for
``<agent_i> ... </agent_i>`` sections; any object with the same two methods can replace it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

__all__ = ["CentralizedComparatorParseError", "CentralizedComparatorAdapter", "TaggedCentralizedComparatorAdapter"]


class CentralizedComparatorParseError(ValueError):
    """A joint completion could not be split into the roles' outputs."""


class CentralizedComparatorAdapter(Protocol):
    """What a centralised adapter provides."""

    def build_prompt(self, batch_item: Mapping[str, Any], agent_prompts: Sequence[str]) -> str:
        """One prompt asking a single policy for every role's output."""

    def parse_completion(self, completion: str, batch_item: Mapping[str, Any], num_agents: int) -> Sequence[str]:
        """The ``num_agents`` role outputs of one joint completion (raise
        :class:`CentralizedComparatorParseError` when it cannot be split)."""


@dataclass(frozen=True)
class TaggedCentralizedComparatorAdapter:
    """Roles marked by indexed tags: the prompt shows each role's own prompt and asks for one
    ``<agent_i>...</agent_i>`` section per role; parsing takes each section's text (a missing
    section is empty; no section at all is a parse error)."""

    def build_prompt(self, batch_item: Mapping[str, Any], agent_prompts: Sequence[str]) -> str:
        roles = len(agent_prompts)
        shown = "\n\n".join(f"Agent {i} original prompt:\n{p}" for i, p in enumerate(agent_prompts))
        wanted = "\n".join(f"<agent_{i}>\n...\n</agent_{i}>" for i in range(roles))
        return (f"Write the outputs of {roles} agents, each answering its own prompt below. Keep them "
                f"separate and write nothing outside the sections.\n\n{shown}\n\n"
                f"Answer with exactly one section per agent:\n{wanted}\n")

    def parse_completion(self, completion: str, batch_item: Mapping[str, Any], num_agents: int) -> list[str]:
        outputs, found = [], False
        for i in range(num_agents):
            match = re.search(rf"<\s*agent_{i}\s*>(.*?)<\s*/\s*agent_{i}\s*>", str(completion),
                              flags=re.IGNORECASE | re.DOTALL)
            found = found or match is not None
            outputs.append(match.group(1).strip() if match else "")
        if not found:
            raise CentralizedComparatorParseError(f"the completion holds none of the sections <agent_0> .. "
                                                  f"<agent_{num_agents - 1}>: {str(completion)[:80]!r}")
        return outputs
