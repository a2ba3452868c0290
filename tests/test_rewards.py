"""Calling the user's reward function: CoMLRL's conventions, one call per task item, checked output."""

import math

import numpy as np
import pytest
import torch

from comlrl import RewardError
from comlrl.engine.rewards import RewardFunction, plan_reward_call
from comlrl.utils import call_reward_function

C1, C2 = ["a", "bb", "ccc"], ["xx", "y", "zzzz"]
PROMPT = "p0"
ITEM = {"prompt": "p0", "id": 0}


def call(func, num_agents=2, processor=None):
    completions = [C1, C2][:num_agents] if num_agents <= 2 else [C1] * num_agents
    return RewardFunction(func, num_agents, processor)(completions, PROMPT, ITEM)


def test_plain_convention_gets_one_list_per_agent_aligned():
    seen = {}

    def reward(completions1, completions2):
        seen["args"] = (completions1, completions2)
        return [len(a) + 10 * len(b) for a, b in zip(completions1, completions2)]

    assert call(reward).tolist() == [21.0, 12.0, 43.0]
    assert seen["args"] == (C1, C2)


def test_prompts_and_items_are_one_entry_per_task_item():
    def leading(prompts, completions1, completions2):
        assert prompts == [PROMPT]
        return [1.0] * len(completions1)

    def keywords(completions1, completions2, *, batch_items, prompts):
        assert batch_items == [ITEM] and prompts == [PROMPT]
        return [2.0] * 3

    def kwargs_only(completions1, completions2, **kwargs):
        assert kwargs["batch_items"] == [ITEM] and kwargs["prompts"] == [PROMPT]
        return [3.0] * 3

    def joint(lists):  # one positional parameter, two agents: a list of the lists
        assert lists == [C1, C2]
        return [4.0] * 3

    assert call(leading).tolist() == [1.0] * 3
    assert call(keywords).tolist() == [2.0] * 3
    assert call(kwargs_only).tolist() == [3.0] * 3
    assert call(joint).tolist() == [4.0] * 3


def test_named_keyword_parameters_are_never_taken_for_completions():
    """CoMLRL 1.4.3 counts ``batch_items=None`` as a third positional parameter, hands the prompts
    to ``completions1`` and then silently drops the rows; here they arrive."""
    def reward(completions1, completions2, batch_items=None):
        assert completions1 == C1 and batch_items == [ITEM]
        return [1.0] * 3

    def scaled(completions1, completions2, scale=2.0):
        assert completions1 == C1
        return [scale] * 3

    assert call(reward).tolist() == [1.0] * 3
    assert call(scaled).tolist() == [2.0] * 3
    assert plan_reward_call(reward, 2, strict=False).leading_prompts  # what 1.4.3's counting does


def test_varargs_and_numpy_and_tensor_returns():
    assert call(lambda *cs: np.array([1, 2, 3])).tolist() == [1.0, 2.0, 3.0]
    assert call(lambda a, b: torch.tensor([0.5, 0.5, 0.5])).tolist() == [0.5] * 3


def test_processor_is_applied_and_checked():
    assert call(lambda a, b: [1, 2, 3], processor=lambda r: r * 10).tolist() == [10.0, 20.0, 30.0]
    with pytest.raises(RewardError, match="reward_processor.*finite"):
        call(lambda a, b: [1, 2, 3], processor=lambda r: math.inf)


@pytest.mark.parametrize("returned, words", [
    ([1.0, 2.0], "returned 2 value.s. for 3 joint actions"),
    ([1.0, 2.0, 3.0, 4.0], "returned 4 value.s. for 3"),
    ([1.0, float("nan"), 1.0], "nan at index 1"),
    ([1.0, 1.0, float("inf")], "inf at index 2"),
    ([1.0, 1e39, 1.0], "float32 range"),
    ([1.0, 10 ** 400, 1.0], "too large for a float at index 1"),
    ([1.0, "2", 1.0], "non-number at index 1"),
    ([1.0, None, 1.0], "non-number at index 1"),
    ([True, 1.0, 1.0], "non-number at index 0"),
    (3.0, "returned 1 value.s. for 3"),
    ("1,2,3", "returned 1 value.s. for 3"),
    (None, "returned 1 value.s. for 3"),
])
def test_bad_returns_are_named(returned, words):
    with pytest.raises(RewardError, match=words):
        call(lambda a, b: returned)


def test_a_raising_reward_is_wrapped_with_its_name():
    def exploding_reward(completions1, completions2):
        raise KeyError("boom")

    with pytest.raises(RewardError, match="exploding_reward raised KeyError") as info:
        call(exploding_reward)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_type_error_inside_the_reward_is_not_retried():
    """CoMLRL 1.4.3 calls the function a second time without keywords on any TypeError."""
    calls = []

    def reward(completions1, completions2, *, batch_items):
        calls.append(batch_items)
        raise TypeError("a bug inside the reward")

    with pytest.raises(RewardError, match="a bug inside the reward"):
        call(reward)
    assert calls == [[ITEM]]


def test_wrong_arity_is_refused_up_front():
    with pytest.raises(RewardError, match="cannot take the completions of 2 agent"):
        RewardFunction(lambda a, b, c, d: [1.0], num_agents=2)
    with pytest.raises(RewardError, match="callable"):
        RewardFunction("not a function", num_agents=2)


def test_public_helper_keeps_comlrl_protocol():
    """comlrl.utils.call_reward_function: CoMLRL's counting and its one retry on TypeError."""
    def two(a, b):
        return (1, 2)

    assert call_reward_function(two, ["p"], [["x"], ["y"]], num_agents=2) == [1.0, 2.0]
    assert call_reward_function(lambda p, a, b: 5, ["p"], [["x"], ["y"]], num_agents=2) == [5.0]
