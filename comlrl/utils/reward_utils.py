"""Reward helpers with CoMLRL's semantics: calling a reward function, reward ranges, lengths.

Trainers call the reward function through :class:`comlrl.engine.rewards.RewardFunction`, which
binds the arguments once from the signature. :func:`call_reward_function` keeps CoMLRL's
call-time protocol for code that uses it directly: the same binding read from the signature,
and on a ``TypeError`` one retry with the completion lists alone; with no readable signature it
tries ``f(*lists, batch_items=...)``, ``f(*lists)`` and ``f(lists)`` in turn.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Sequence

from ..engine.rewards import plan_reward_call, to_float_list

__all__ = ["call_reward_function", "normalize_reward_lengths", "resolve_reward_range", "set_reward_range"]


def call_reward_function(reward_func: Callable, prompts: Sequence[Any], agent_completions: Sequence[Sequence[str]],
                         *, num_agents: int, batch_items: Optional[Sequence[Any]] = None,
                         signature: Any = None) -> list[float]:
    """Call ``reward_func`` on one list of completions per agent; returns its values as floats."""
    lists = [c for c in agent_completions]
    plan = plan_reward_call(reward_func, num_agents, strict=False)
    if plan is None:
        attempts = ([((*lists,), {"batch_items": batch_items})] if batch_items is not None else []) + \
                   [((*lists,), {}), ((lists,), {})]
    else:
        args, kwargs = plan.args(lists, list(prompts), None if batch_items is None else list(batch_items))
        attempts = [(tuple(args), kwargs), ((*lists,), {})]
    first: Optional[TypeError] = None
    for args, kwargs in attempts:
        try:
            values = reward_func(*args, **kwargs)
        except TypeError as exc:
            first = first or exc
            continue
        return [float(v) for v in to_float_list(values)]
    raise first  # type: ignore[misc]


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
