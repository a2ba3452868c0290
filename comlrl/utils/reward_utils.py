"""Reward helpers with CoMLRL's semantics: calling a reward function, reward ranges, lengths.

:func:`call_reward_function` is the trainers' own binding (:mod:`comlrl.engine.rewards`), for
code that calls a reward function directly: the same reading of the signature, the same clear
error when the function cannot take the arguments, one call with the lists as given.
:func:`batched_reward` marks a reward that trainers should call once per task item.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Optional, Sequence, TypeVar

from ..engine.rewards import (BATCHED_ATTRIBUTE, RewardCall, check_reward_binding, plan_reward_call,
                              to_float_list)

__all__ = ["call_reward_function", "batched_reward", "normalize_reward_lengths", "resolve_reward_range",
           "set_reward_range"]

F = TypeVar("F", bound=Callable[..., Any])


def call_reward_function(reward_func: Callable, prompts: Sequence[Any], agent_completions: Sequence[Sequence[str]],
                         *, num_agents: int, batch_items: Optional[Sequence[Any]] = None,
                         signature: Optional[inspect.Signature] = None) -> list[float]:
    """Call ``reward_func`` once on one list of completions per agent; returns its values as floats.

    Args:
        prompts: passed as ``prompts`` (or as the leading positional list), as given.
        agent_completions: ``[num_agents][J]`` completion strings.
        batch_items: passed as ``batch_items`` when the function takes it (None: not passed).
        signature: the function's signature, if already read.
    Raises:
        RewardError: the function cannot take these arguments (before calling it). An exception
            raised inside the function propagates unchanged; it is never called a second time.
    """
    call = plan_reward_call(reward_func, num_agents, signature) or RewardCall()
    check_reward_binding(reward_func, call, num_agents, signature)
    args, kwargs = call.args(agent_completions, prompts, batch_items)
    return [float(v) for v in to_float_list(reward_func(*args, **kwargs))]


def batched_reward(reward_func: F) -> F:
    """Mark ``reward_func`` to be called once per task item and turn with all of its joint actions
    (``prompts`` and ``batch_items`` repeated to the same length) instead of once per joint action
    (CoMLRL 1.4.3's call, the default); returns it. For a callable object, set the class attribute
    ``reward_batched = True`` instead."""
    setattr(reward_func, BATCHED_ATTRIBUTE, True)
    return reward_func


def normalize_reward_lengths(rewards: Sequence[Any], *, num_agents: int, num_generations: int,
                             algorithm: str = "") -> list[float]:
    """Rewards as a list of floats: one per agent. A single value is shared by every agent; a list
    of ``num_agents`` or ``num_generations`` values is kept; one agent keeps whatever it got."""
    if num_generations < 1:
        raise ValueError(f"{algorithm or 'reward'}: num_generations must be >= 1, got {num_generations}.")
    values = [float(v) for v in rewards]
    if num_agents == 1:
        return values
    if len(values) == 1:
        return values * num_agents
    if len(values) in (num_agents, num_generations):
        return values
    raise ValueError(f"{algorithm or 'reward'}: the reward function returned {len(values)} values; expected 1, "
                     f"{num_agents} (one per agent) or {num_generations} (one per generation).")


def resolve_reward_range(reward_func: Any) -> Optional[tuple[float, float]]:
    """``reward_func.reward_range`` as ``(min, max)`` floats, or None when it has none."""
    value = getattr(reward_func, "reward_range", None)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"reward_range must be a (min, max) pair, got {value!r}.")
    low, high = value
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high)) \
            or not low < high:
        raise ValueError(f"reward_range must hold two finite numbers with min < max, got {value!r}.")
    return float(low), float(high)


def set_reward_range(reward_func: Callable, minimum: float, maximum: float) -> Callable:
    """Attach ``reward_range = (minimum, maximum)`` to ``reward_func`` (checked) and return it."""
    reward_func.reward_range = (float(minimum), float(maximum))
    resolve_reward_range(reward_func)
    return reward_func
