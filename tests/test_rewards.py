import math

import numpy as np
import pytest
import torch

from comlrl import RewardError
from comlrl.rewards import RewardFunction

C1, C2 = ["a", "bb", "ccc"], ["xx", "y", "zzzz"]
PROMPTS = ["p0", "p1", "p2"]
ITEMS = [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)]


def call(func, num_agents=2, processor=None):
    completions = [C1, C2][:num_agents] if num_agents <= 2 else [C1] * num_agents
    return RewardFunction(func, num_agents, processor)(completions, PROMPTS, ITEMS)


def test_plain_convention_gets_one_list_per_agent_aligned():
    seen = {}

    def reward(completions1, completions2):
        seen["args"] = (completions1, completions2)
        return [len(a) + 10 * len(b) for a, b in zip(completions1, completions2)]

    assert call(reward).tolist() == [21.0, 12.0, 43.0]
    assert seen["args"] == (C1, C2)


def test_leading_prompts_and_keywords():
    def leading(prompts, completions1, completions2):
        assert prompts == PROMPTS
        return [1.0] * len(prompts)

    def keywords(completions1, completions2, batch_items=None, prompts=None):
        assert batch_items == ITEMS and prompts == PROMPTS
        return [2.0] * 3

    def kwargs_only(completions1, completions2, **kwargs):
        assert kwargs["batch_items"] == ITEMS
        return [3.0] * 3

    assert call(leading).tolist() == [1.0] * 3
    assert call(keywords).tolist() == [2.0] * 3
    assert call(kwargs_only).tolist() == [3.0] * 3


def test_varargs_and_numpy_and_tensor_returns():
    assert call(lambda *cs: np.array([1, 2, 3])).tolist() == [1.0, 2.0, 3.0]
    assert call(lambda a, b: torch.tensor([0.5, 0.5, 0.5])).tolist() == [0.5] * 3


def test_processor_is_applied_and_checked():
    assert call(lambda a, b: [1, 2, 3], processor=lambda r: r * 10).tolist() == [10.0, 20.0, 30.0]
    with pytest.raises(RewardError, match="reward_processor.*finite"):
        call(lambda a, b: [1, 2, 3], processor=lambda r: math.inf)


@pytest.mark.parametrize("returned, words", [
    ([1.0, 2.0], "returned 2 values for 3 joint actions"),
    ([1.0, 2.0, 3.0, 4.0], "returned 4 values for 3"),
    ([1.0, float("nan"), 1.0], "nan at index 1"),
    ([1.0, 1.0, float("inf")], "inf at index 2"),
    ([1.0, "2", 1.0], "non-number at index 1"),
    ([1.0, None, 1.0], "non-number at index 1"),
    ([True, 1.0, 1.0], "non-number at index 0"),
    (3.0, "must return a list"),
    ("1,2,3", "must return a list"),
    (None, "must return a list"),
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


def test_wrong_arity_is_refused_up_front():
    with pytest.raises(RewardError, match="one list of completions per agent"):
        RewardFunction(lambda a: [1.0], num_agents=2)
    with pytest.raises(RewardError, match="one list of completions per agent"):
        RewardFunction(lambda a, b, c: [1.0], num_agents=2)
    with pytest.raises(RewardError, match="callable"):
        RewardFunction("not a function", num_agents=2)
