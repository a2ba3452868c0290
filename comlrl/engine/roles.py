"""Centralised runs: one policy plays every role. The joint prompt is built from the roles' own
prompts, and each joint completion is split back into role outputs wherever the task looks at
the roles separately (the reward, evaluation metrics); the policy itself learns from the joint text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from ..exceptions import ConfigError, RewardError
from .prompts import Formatter
from .rewards import RewardFunction

__all__ = ["RoleSplit", "RoleReward", "CentralizedComparatorParseError", "CentralizedComparatorAdapter",
           "TaggedCentralizedComparatorAdapter"]


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


class RoleSplit:
    """An adapter (``build_prompt`` / ``parse_completion``) and the roles' formatters."""

    def __init__(self, adapter: Any, role_formatters: Sequence[Formatter]):
        for method in ("build_prompt", "parse_completion"):
            if not callable(getattr(adapter, method, None)):
                raise ConfigError(f"the centralized adapter must have a callable {method}(); "
                                  f"{type(adapter).__name__} has none. Use TaggedCentralizedComparatorAdapter().")
        self.adapter, self.formatters = adapter, list(role_formatters)
        self.num_roles = len(self.formatters)

    def role_prompt(self, item: Mapping[str, Any], role: int) -> Any:
        return self.formatters[role](item)

    def joint_prompt(self, item: Mapping[str, Any]) -> str:
        """The one prompt of the joint policy (a formatter of the single actor)."""
        prompt = self.adapter.build_prompt(item, [f(item) for f in self.formatters])
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"the centralized adapter's build_prompt returned {prompt!r:.60}; it must return a "
                              "non-empty prompt string.")
        return prompt

    def split(self, completion: str, item: Mapping[str, Any]) -> list[str]:
        """The roles' outputs of one joint completion; all empty when it cannot be parsed."""
        try:
            outputs = self.adapter.parse_completion(completion, item, self.num_roles)
        except CentralizedComparatorParseError:
            return [""] * self.num_roles
        if isinstance(outputs, (str, bytes)) or len(outputs) != self.num_roles or \
                not all(isinstance(o, str) for o in outputs):
            raise RewardError(f"the centralized adapter's parse_completion must return {self.num_roles} strings (one "
                              f"per role), got {outputs!r:.80}.")
        return list(outputs)


class RoleReward:
    """The task's reward on role outputs: called like a :class:`RewardFunction` with the joint
    actor's completions (``[1][J]``), it scores the roles' outputs (``[roles][J]``)."""

    def __init__(self, reward: RewardFunction, roles: RoleSplit):
        self.reward, self.roles = reward, roles
        self.func = reward.func

    def __call__(self, completions: Sequence[Sequence[str]], prompt: Any, item: Any,
                 agent_prompts: Optional[Sequence[Any]] = None) -> torch.Tensor:
        split = [self.roles.split(c, item) for c in completions[0]]
        per_role = [[outputs[r] for outputs in split] for r in range(self.roles.num_roles)]
        return self.reward(per_role, self.roles.role_prompt(item, 0), item)
