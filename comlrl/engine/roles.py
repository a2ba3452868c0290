"""Centralised runs: one policy plays every role. The joint prompt is built from the roles' own
prompts, and each joint completion is split back into role outputs wherever the task looks at
the roles separately (the reward, evaluation metrics); the policy itself learns from the joint text.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..exceptions import ConfigError, RewardError
from ..trainers.preference.centralized import CentralizedComparatorParseError
from .prompts import Formatter
from .rewards import RewardFunction

__all__ = ["RoleSplit", "RoleReward"]


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

    def __call__(self, completions: Sequence[Sequence[str]], prompt: Any, item: Any) -> torch.Tensor:
        split = [self.roles.split(c, item) for c in completions[0]]
        per_role = [[outputs[r] for outputs in split] for r in range(self.roles.num_roles)]
        return self.reward(per_role, self.roles.role_prompt(item, 0), item)
