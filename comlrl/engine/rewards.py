"""Calling the user's reward function, and checking what it returns.

The conventions are CoMLRL's (:func:`comlrl.utils.call_reward_function` exposes them): the function
gets one list of completion strings per agent, aligned (element i of every list forms joint action
i), and returns one number per joint action. How the lists are passed is read from its signature:

* ``f(completions1, ..., completionsN)``: one positional parameter per agent;
* ``f(prompts, completions1, ..., completionsN)``: one more leading positional parameter;
* ``f(joint)`` with one positional parameter and N > 1 agents: a list of the N lists;
* ``*args``: the lists positionally;
* keyword parameters ``prompts`` / ``batch_items`` (or ``**kwargs``) receive the task's prompt and
  dataset row, one entry per task item in the call.

Unlike CoMLRL 1.4.3 a parameter named ``prompts`` or ``batch_items`` is never counted as a
completions list (``def r(a, b, batch_items=None)`` gets its rows), and parameters with a default
value are not either (``def r(a, b, scale=1.0)`` is not handed the prompts as ``a``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..exceptions import RewardError

__all__ = ["RewardCall", "plan_reward_call", "RewardFunction", "to_float_list", "FLOAT32_MAX"]

KEYWORDS = ("prompts", "batch_items")
# Rewards become float32 advantages in the loss; beyond this they would be inf there.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class RewardCall:
    """How a reward function takes its arguments, read once from its signature."""

    leading_prompts: bool = False     # f(prompts, c1, ..., cN)
    joint_list: bool = False          # f([c1, ..., cN])
    keywords: frozenset = frozenset()  # which of prompts / batch_items it takes by keyword

    def args(self, completions: Sequence[list[str]], prompts: list[Any], batch_items: Optional[list[Any]]
             ) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments of one call."""
        args: list[Any] = [list(completions)] if self.joint_list else [list(c) for c in completions]
        if self.leading_prompts:
            args.insert(0, prompts)
        kwargs: dict[str, Any] = {}
        if "batch_items" in self.keywords and batch_items is not None:
            kwargs["batch_items"] = batch_items
        if "prompts" in self.keywords and not self.leading_prompts:
            kwargs["prompts"] = prompts
        return args, kwargs


def plan_reward_call(func: Callable, num_agents: int, strict: bool = True) -> Optional[RewardCall]:
    """How to call ``func`` for ``num_agents`` agents; None if its signature cannot be read.

    ``strict=False`` counts positional parameters as CoMLRL 1.4.3 does (every positional
    parameter, whatever its name or default), for :func:`comlrl.utils.call_reward_function`.
    """
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in params)
    keywords = frozenset(n for n in KEYWORDS if var_kw or any(p.name == n and p.kind is not P.POSITIONAL_ONLY
                                                              for p in params))
    if var_pos:
        return RewardCall(keywords=keywords if var_kw else frozenset())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if not strict:
        count = len(positional)
    elif positional and positional[0].name == "prompts":
        return RewardCall(leading_prompts=True, keywords=keywords - {"prompts"})
    else:
        rest = [p for p in positional if p.name not in KEYWORDS or p.kind is P.POSITIONAL_ONLY]
        required = len([p for p in rest if p.default is P.empty])
        count = required if required in (1, num_agents, num_agents + 1) else num_agents
    if num_agents == 1:
        return RewardCall(leading_prompts=count != 1, keywords=keywords - ({"prompts"} if count != 1 else set()))
    if count == num_agents + 1:
        return RewardCall(leading_prompts=True, keywords=keywords - {"prompts"})
    if count == 1:
        return RewardCall(joint_list=True, keywords=keywords)
    return RewardCall(keywords=keywords)


def to_float_list(values: Any) -> list[Any]:
    """A reward function's output as a list: a tensor or array flattened, a scalar as one item."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().reshape(-1).tolist()
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()  # numpy arrays and scalars
    if isinstance(values, (list, tuple)):
        return list(values)
    return [values]


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__


class RewardFunction:
    """The user's ``reward_func`` (and ``reward_processor``), called once per task item.

    Args:
        func: the reward function (conventions in the module docstring).
        num_agents: how many completion lists it gets.
        processor: ``float -> float`` applied to every reward it returns.
    """

    def __init__(self, func: Callable, num_agents: int, processor: Optional[Callable[[float], float]] = None,
                 per_agent: bool = False):
        if not callable(func):
            raise RewardError(f"reward_func must be a callable: f(completions1, ..., completionsN) -> list of "
                              f"floats; got {type(func).__name__}.")
        if processor is not None and not callable(processor):
            raise RewardError(f"reward_processor must be callable (float -> float), got {type(processor).__name__}.")
        self.func, self.processor, self.num_agents, self.per_agent = func, processor, num_agents, per_agent
        self.name = _name(func)
        self.call = plan_reward_call(func, num_agents) or RewardCall()
        self._check_binding()

    def _check_binding(self) -> None:
        """A function that cannot take the planned arguments fails now, not at the first step."""
        try:
            signature = inspect.signature(self.func)
        except (TypeError, ValueError):
            return
        args, kwargs = self.call.args([[""]] * self.num_agents, [""], [{}])
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            lists = ", ".join(f"completions{i + 1}" for i in range(self.num_agents))
            raise RewardError(f"reward function {self.name}{signature} cannot take the completions of "
                              f"{self.num_agents} agent(s) ({exc}); define it as def reward({lists}) -> list of "
                              "floats (optionally with keyword parameters prompts=None, batch_items=None).") from None

    def __call__(self, completions: Sequence[Sequence[str]], prompt: Any, item: Any) -> torch.Tensor:
        """Score the joint actions of one task item.

        Args:
            completions: ``[num_agents][J]`` strings; element j of every list is joint action j.
            prompt: the item's prompt (agent 0's, this turn), passed as ``prompts=[prompt]``.
            item: the dataset row, passed as ``batch_items=[item]``.
        Returns:
            ``[J]`` float64 rewards (after ``reward_processor``); with ``per_agent``, ``[N, J]`` when the
            function gave each agent its own reward (see :meth:`_per_agent`).
        Raises:
            RewardError: the function raised, or returned anything but J finite numbers.
        """
        count = len(completions[0])
        args, kwargs = self.call.args(completions, [prompt], [item])
        try:
            values = self.func(*args, **kwargs)
        except Exception as exc:  # the user's code failed: say so, keep the original as the cause
            raise RewardError(f"reward function {self.name} raised {type(exc).__name__}: {exc}") from exc
        values = to_float_list(values)
        if self.per_agent:
            split = self._per_agent(values, count)
            if split is not None:
                return torch.stack([self._finish(v, len(v)) for v in split])
            if len(values) == 1 and count > 1:
                values = values * count
        return self._finish(values, count)

    def _per_agent(self, values: list[Any], count: int) -> Optional[list[list[Any]]]:
        """Per-agent rewards (actor-critic trainers), CoMLRL's conventions plus one: N lists of J
        values (each agent's reward of every joint action); else N values when J != N (each agent's
        reward, the same for its J joint actions). J values are the joint reward of each joint
        action, as everywhere (when J == N, N values are read as that)."""
        n = self.num_agents
        if values and all(isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) >= 1 for v in values):
            rows = [to_float_list(v) for v in values]
            if len(rows) != n or any(len(r) != count for r in rows):
                raise RewardError(f"reward function {self.name} returned {len(rows)} lists of lengths "
                                  f"{[len(r) for r in rows]}; per-agent rewards are {n} lists of {count} floats (one "
                                  "per joint action).")
            return rows
        if n > 1 and len(values) == n and count != n:
            return [[v] * count for v in values]
        return None

    def _finish(self, values: list[Any], count: int) -> torch.Tensor:
        rewards = check_rewards(values, count, f"reward function {self.name}")
        if self.processor is not None:
            try:
                processed = [self.processor(r) for r in rewards]
            except Exception as exc:
                raise RewardError(f"reward_processor raised {type(exc).__name__}: {exc}") from exc
            rewards = check_rewards(processed, count, f"reward_processor after {self.name}")
        return torch.tensor(rewards, dtype=torch.float64)


def check_rewards(values: list[Any], count: int, who: str) -> list[float]:
    """``values`` as ``count`` finite floats that fit float32, or a RewardError saying what is wrong."""
    if len(values) != count:
        raise RewardError(f"{who} returned {len(values)} value(s) for {count} joint actions of one task item; "
                          "return exactly one float per joint action (element i of each agent's list).")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardError(f"{who} returned a non-number at index {i}: {v!r:.80} ({type(v).__name__}); "
                              "rewards must be int or float.")
        try:
            v = float(v)
        except OverflowError:
            raise RewardError(f"{who} returned an integer too large for a float at index {i}; "
                              "rewards must be finite floats.") from None
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            raise RewardError(f"{who} returned {v} at index {i}; rewards must be finite and within float32 range "
                              f"(|r| <= {FLOAT32_MAX:.3g}).")
        out.append(v)
    return out
