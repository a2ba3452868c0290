"""Calling the user's reward function, and checking what it returns.

The conventions are CoMLRL's (:func:`comlrl.utils.call_reward_function` is the same code for
direct callers): the function gets one list of completion strings per agent, aligned (element i
of every list forms joint action i), with ``prompts`` and ``batch_items`` lists of the same length
(element i is joint action i's prompt and dataset row), and returns one number per joint action.

**Call shape.** By default the function is called once per joint action, with one-element lists,
exactly as CoMLRL 1.4.3 calls it: a reward written for 1.4.3 (``batch_items[i]`` beside
``completions[i]``) sees 1.4.3's arguments. A function marked with
:func:`comlrl.utils.batched_reward` (attribute ``reward_batched = True``) is called once per task
item and turn with all of its J joint actions (K aligned, K**N cross), ``prompts`` and
``batch_items`` repeated J times: faster where the reward does per-call work once (the code task
checks every program of a call in one sandbox batch).

**Arguments, read from the signature** (named, keyword-only, ``*args``, ``**kwargs``):

* ``f(completions1, ..., completionsN)``: one positional parameter per agent;
* ``f(prompts, completions1, ..., completionsN)``: one more leading positional parameter;
* ``f(joint)`` with one positional parameter and N > 1 agents: a list of the N lists;
* ``f(*completions)``: the lists positionally;
* parameters named ``prompts`` / ``batch_items`` (positional-or-keyword or keyword-only), or
  ``**kwargs``, get them by keyword, whatever the positional form (``*args`` included);
* a required parameter comlrl has no value for (``def r(a, b, *, tokenizer)``) is refused when the
  trainer is built, naming it.

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

from .._redact import redact_text
from ..exceptions import RewardError

__all__ = ["RewardCall", "plan_reward_call", "check_reward_binding", "reward_is_batched", "RewardFunction",
           "to_float_list", "FLOAT32_MAX", "BATCHED_ATTRIBUTE", "user_failure"]

KEYWORDS = ("prompts", "batch_items")
#: The attribute that opts a reward function into one call per task item (see the module docstring).
BATCHED_ATTRIBUTE = "reward_batched"
# Rewards become float32 advantages in the loss; beyond this they would be inf there.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class RewardCall:
    """How a reward function takes its arguments, read once from its signature."""

    leading_prompts: bool = False     # f(prompts, c1, ..., cN)
    joint_list: bool = False          # f([c1, ..., cN])
    keywords: frozenset = frozenset()  # which of prompts / batch_items it takes by keyword

    def args(self, completions: Sequence[Sequence[str]], prompts: Sequence[Any],
             batch_items: Optional[Sequence[Any]]) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments of one call (``batch_items=None``: not passed)."""
        args: list[Any] = [[list(c) for c in completions]] if self.joint_list else [list(c) for c in completions]
        if self.leading_prompts:
            args.insert(0, list(prompts))
        kwargs: dict[str, Any] = {}
        if "batch_items" in self.keywords and batch_items is not None:
            kwargs["batch_items"] = list(batch_items)
        if "prompts" in self.keywords and not self.leading_prompts:
            kwargs["prompts"] = list(prompts)
        return args, kwargs



def user_failure(error: type[Exception], what: str, exc: Exception) -> Exception:
    """``error`` saying that the user's ``what`` raised ``exc``, its message with credentials
    hidden (a reward calling an API may fail with its key in the text). The original is chained
    as the cause when its message is clean; otherwise it is kept out of every traceback, on the
    error's ``original`` attribute only."""
    text = str(exc)
    shown = redact_text(text)
    failure = error(f"{what} raised {type(exc).__name__}: {shown}")
    if shown == text:
        failure.__cause__ = exc
    else:
        failure.__suppress_context__ = True
        failure.original = exc  # type: ignore[attr-defined]
    return failure

def _signature(func: Callable, signature: Optional[inspect.Signature] = None) -> Optional[inspect.Signature]:
    if signature is not None:
        return signature
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def plan_reward_call(func: Callable, num_agents: int, signature: Optional[inspect.Signature] = None
                     ) -> Optional[RewardCall]:
    """How to call ``func`` for ``num_agents`` agents (module docstring); None if its signature
    cannot be read (a builtin), which is then called with the lists positionally."""
    sig = _signature(func, signature)
    if sig is None:
        return None
    params = list(sig.parameters.values())
    P = inspect.Parameter
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in params)
    named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    keywords = frozenset(n for n in KEYWORDS if var_kw or n in named)
    if var_pos:  # f(*completions, batch_items=None, prompts=None): the keywords still arrive
        return RewardCall(keywords=keywords)
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if positional and positional[0].name == "prompts":
        return RewardCall(leading_prompts=True, keywords=keywords - {"prompts"})
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


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__


def check_reward_binding(func: Callable, call: RewardCall, num_agents: int,
                         signature: Optional[inspect.Signature] = None) -> None:
    """Raise :class:`RewardError` if ``func`` cannot take the arguments ``call`` gives it: a
    required parameter comlrl has no value for is named, with what comlrl passes."""
    sig = _signature(func, signature)
    if sig is None:
        return
    args, kwargs = call.args([[""]] * num_agents, [""], [{}])
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = _name(func)
        lists = ", ".join(f"completions{i + 1}" for i in range(num_agents))
        P = inspect.Parameter
        unknown = [p.name for p in sig.parameters.values() if p.kind is P.KEYWORD_ONLY and p.default is P.empty
                   and p.name not in KEYWORDS]
        if unknown:
            asked = ", ".join(map(repr, unknown))
            raise RewardError(f"reward function {name}{sig} asks for {asked}, which comlrl does not pass: a reward "
                              f"gets {lists} and, by keyword, prompts= and batch_items= (each joint action's prompt "
                              "and dataset row). Give it a default or read it from batch_items.") from None
        raise RewardError(f"reward function {name}{sig} cannot take the completions of {num_agents} agent(s) ({exc}); "
                          f"define it as def reward({lists}) -> list of floats (optionally with keyword parameters "
                          "prompts=None, batch_items=None).") from None


def reward_is_batched(func: Callable) -> bool:
    """Whether ``func`` asked for one call per task item (``reward_batched = True``, set by
    :func:`comlrl.utils.batched_reward`)."""
    value = getattr(func, BATCHED_ATTRIBUTE, False)
    if not isinstance(value, bool):
        raise RewardError(f"reward function {_name(func)}: {BATCHED_ATTRIBUTE} must be True or False, got {value!r}; "
                          "use comlrl.utils.batched_reward(func) to mark a batched reward.")
    return value


def to_float_list(values: Any) -> list[Any]:
    """A reward function's output as a list: a tensor or array flattened, a scalar as one item."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().reshape(-1).tolist()
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()  # numpy arrays and scalars
    if isinstance(values, (list, tuple)):
        return list(values)
    return [values]


class RewardFunction:
    """The user's ``reward_func`` (and ``reward_processor``), called for one task item at a time:
    once per joint action by default, once for all of them when batched (module docstring).

    Args:
        func: the reward function (conventions in the module docstring).
        num_agents: how many completion lists it gets.
        processor: ``float -> float`` applied to every reward it returns.
        per_agent: whether it may give each agent its own reward (actor-critic families).
        agent_prompts: a per-joint-action call's ``prompts`` holds every agent's prompt (CoMLRL
            1.4.3's actor-critic trainers pass them so) instead of agent 0's.
    """

    def __init__(self, func: Callable, num_agents: int, processor: Optional[Callable[[float], float]] = None,
                 per_agent: bool = False, agent_prompts: bool = False):
        if not callable(func):
            raise RewardError(f"reward_func must be a callable: f(completions1, ..., completionsN) -> list of "
                              f"floats; got {type(func).__name__}.")
        if processor is not None and not callable(processor):
            raise RewardError(f"reward_processor must be callable (float -> float), got {type(processor).__name__}.")
        self.func, self.processor, self.num_agents, self.per_agent = func, processor, num_agents, per_agent
        self.agent_prompts = agent_prompts
        self.name = _name(func)
        self.call = plan_reward_call(func, num_agents) or RewardCall()
        check_reward_binding(func, self.call, num_agents)  # a function that cannot take them fails now
        self.batched = reward_is_batched(func)

    def __call__(self, completions: Sequence[Sequence[str]], prompt: Any, item: Any,
                 agent_prompts: Optional[Sequence[Any]] = None) -> torch.Tensor:
        """Score the joint actions of one task item.

        Args:
            completions: ``[num_agents][J]`` strings; element j of every list is joint action j.
            prompt: the item's prompt (agent 0's, this turn), each call's ``prompts`` entries.
            item: the dataset row, each call's ``batch_items`` entries.
            agent_prompts: every agent's prompt this turn (``agent_prompts=True``: a per-joint-action
                call's ``prompts``).
        Returns:
            ``[J]`` float64 rewards (after ``reward_processor``); with ``per_agent``, ``[N, J]`` when the
            function gave each agent its own reward (see :meth:`_per_agent`).
        Raises:
            RewardError: the function raised, or returned anything but one finite number per joint action.
        """
        count = len(completions[0])
        if self.batched:
            return self._score(self._invoke(completions, [prompt] * count, [item] * count), count)
        prompts = list(agent_prompts) if self.agent_prompts and agent_prompts is not None else [prompt]
        parts = [self._score(self._invoke([[c[j]] for c in completions], prompts, [item]), 1) for j in range(count)]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        if any(p.dim() == 2 for p in parts):  # some joint actions gave each agent its own reward
            return torch.cat([p if p.dim() == 2 else p.expand(self.num_agents, -1) for p in parts], dim=1)
        return torch.cat(parts)

    def _invoke(self, completions: Sequence[Sequence[str]], prompts: list[Any], items: list[Any]) -> list[Any]:
        args, kwargs = self.call.args(completions, prompts, items)
        try:
            values = self.func(*args, **kwargs)
        except Exception as exc:  # the user's code failed: say so, keep the original as the cause
            raise user_failure(RewardError, f"reward function {self.name}", exc)
        return to_float_list(values)

    def _score(self, values: list[Any], count: int) -> torch.Tensor:
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
        rewards = check_rewards(values, count, f"reward function {self.name}", batched=self.batched,
                                hint=self._joint_list_hint())
        if self.processor is not None:
            try:
                processed = [self.processor(r) for r in rewards]
            except Exception as exc:
                raise user_failure(RewardError, "reward_processor", exc)
            rewards = check_rewards(processed, count, f"reward_processor after {self.name}", batched=self.batched)
        return torch.tensor(rewards, dtype=torch.float64)


    def _joint_list_hint(self) -> str:
        """What a one-parameter reward of several agents receives, for a count mismatch: such a
        function most often iterates over its argument as if it were one list of completions."""
        if not self.call.joint_list:
            return ""
        n = self.num_agents
        return (f" {self.name} takes one positional parameter, so with {n} agents it receives a single argument: a "
                f"list of {n} lists, one list of completions per agent (element i of each list is joint action i). "
                f"Score zip(*that_argument), one float per joint action, or define it as def "
                f"{getattr(self.func, '__name__', 'reward')}("
                f"{', '.join(f'completions{a + 1}' for a in range(n))}).")


def check_rewards(values: list[Any], count: int, who: str, batched: bool = True, hint: str = "") -> list[float]:
    """``values`` as ``count`` finite floats that fit float32, or a RewardError saying what is wrong
    (``batched=False``: the call was one joint action's, and the message says how to batch; ``hint``
    is added to a count mismatch's message)."""
    if len(values) != count:
        how = ("return exactly one float per joint action (element i of each agent's list)." if batched else
               "it is called once per joint action (one-element lists, as CoMLRL 1.4.3 calls it): return one float, "
               "or mark it with comlrl.utils.batched_reward to score every joint action of a task item in one call.")
        raise RewardError(f"{who} returned {len(values)} value(s) for {count} joint action(s) of one call; {how}{hint}")
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
