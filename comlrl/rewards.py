"""Calling the user's reward function on joint actions, and checking what it returns."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Optional, Sequence

import torch

from .exceptions import RewardError

__all__ = ["RewardFunction"]


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class RewardFunction:
    """Wraps ``reward_func(completions1, completions2, ...)`` for ``num_agents`` agents.

    Conventions accepted (those of the public CoMLRL library):

    * ``f(completions1, ..., completionsN)``: one list of strings per agent, aligned;
    * ``f(prompts, completions1, ..., completionsN)``: an extra leading positional ``prompts``;
    * keyword parameters ``prompts=`` and/or ``batch_items=`` (the dataset rows), passed when the
      function declares them (or takes ``**kwargs``).

    The function is called once per batch and must return one finite real number per joint action.
    An optional ``reward_processor`` (float -> float) is applied to every value afterwards.
    """

    def __init__(self, func: Callable, num_agents: int, processor: Optional[Callable[[float], float]] = None):
        if not callable(func):
            raise RewardError(f"reward_func must be callable, got {type(func).__name__}.")
        if processor is not None and not callable(processor):
            raise RewardError(f"reward_processor must be callable (float -> float), got {type(processor).__name__}.")
        self.func = func
        self.processor = processor
        self.num_agents = num_agents
        self.name = _name(func)
        self._leading_prompts, self._keywords = self._inspect(func, num_agents)

    def _inspect(self, func: Callable, num_agents: int) -> tuple[bool, set[str]]:
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # builtins, some C callables: assume the plain convention
            return False, set()
        kinds = inspect.Parameter
        var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params)
        var_pos = any(p.kind is kinds.VAR_POSITIONAL for p in params)
        positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        keywords = {n for n in ("prompts", "batch_items")
                    if var_kw or any(p.name == n and p.kind is not kinds.POSITIONAL_ONLY for p in params)}
        leading = bool(positional) and positional[0].name == "prompts" and (
            var_pos or len(positional) >= num_agents + 1)
        if leading:
            keywords.discard("prompts")
        required = [p for p in positional if p.default is p.empty and p.name not in keywords]
        n_required = len(required) - (1 if leading else 0)
        if not var_pos and (n_required > num_agents or len(positional) - (1 if leading else 0) < num_agents):
            raise RewardError(
                f"reward function {self.name} takes {len(positional)} positional argument(s) "
                f"({', '.join(p.name for p in positional) or 'none'}), but there are {num_agents} agents: "
                f"it must accept one list of completions per agent, e.g. "
                f"def reward({', '.join(f'completions{i + 1}' for i in range(num_agents))})."
            )
        return leading, keywords

    def __call__(self, completions: Sequence[Sequence[str]], prompts: Sequence[str],
                 batch_items: Sequence[Any]) -> torch.Tensor:
        """Score ``N`` joint actions.

        Args:
            completions: ``[num_agents][N]`` strings; element i of every list is joint action i.
            prompts: ``[N]`` the prompt of each joint action (the first agent's view).
            batch_items: ``[N]`` the dataset row of each joint action.
        Returns:
            ``[N]`` float64 rewards (after ``reward_processor``).
        Raises:
            RewardError: if the function raises, or returns anything but N finite real numbers.
        """
        count = len(completions[0])
        args: list[Any] = [list(prompts)] if self._leading_prompts else []
        args += [list(c) for c in completions]
        kwargs = {}
        if "prompts" in self._keywords:
            kwargs["prompts"] = list(prompts)
        if "batch_items" in self._keywords:
            kwargs["batch_items"] = list(batch_items)
        try:
            values = self.func(*args, **kwargs)
        except Exception as exc:  # the user's code failed: say so, keep the original as the cause
            raise RewardError(f"reward function {self.name} raised {type(exc).__name__}: {exc}") from exc
        rewards = self._check(values, count, self.name)
        if self.processor is not None:
            try:
                processed = [self.processor(r) for r in rewards]
            except Exception as exc:
                raise RewardError(f"reward_processor raised {type(exc).__name__}: {exc}") from exc
            rewards = self._check(processed, count, f"reward_processor after {self.name}")
        return torch.tensor(rewards, dtype=torch.float64)

    @staticmethod
    def _check(values: Any, count: int, who: str) -> list[float]:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().reshape(-1).tolist()
        elif hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
            values = values.tolist()  # numpy arrays
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
            raise RewardError(f"{who} must return a list of {count} floats (one per joint action), "
                              f"got {type(values).__name__}.")
        if len(values) != count:
            raise RewardError(f"{who} returned {len(values)} values for {count} joint actions; "
                              f"return exactly one float per joint action (element i of each agent's list).")
        out = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise RewardError(f"{who} returned a non-number at index {i}: {v!r} ({type(v).__name__}); "
                                  "rewards must be int or float.")
            v = float(v)
            if not math.isfinite(v):
                raise RewardError(f"{who} returned {v} at index {i}; rewards must be finite (no NaN or inf).")
            out.append(v)
        return out
