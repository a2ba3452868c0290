"""Calling the user's reward function: CoMLRL's conventions, one call per joint action (or per
task item when batched), checked output. The task repositories' patterns, against CoMLRL 1.4.3's
recorded calls: tests/test_task_repos.py."""

import math

import numpy as np
import pytest
import torch

from comlrl import RewardError
from comlrl.engine.rewards import RewardFunction, plan_reward_call
from comlrl.utils import batched_reward, call_reward_function

C1, C2 = ["a", "bb", "ccc"], ["xx", "y", "zzzz"]
PROMPT = "p0"
ITEM = {"prompt": "p0", "id": 0}


def call(func, num_agents=2, processor=None):
    completions = [C1, C2][:num_agents] if num_agents <= 2 else [C1] * num_agents
    return RewardFunction(func, num_agents, processor)(completions, PROMPT, ITEM)


def test_plain_convention_one_call_per_joint_action():
    seen = []

    def reward(completions1, completions2):
        seen.append((completions1, completions2))
        return [len(a) + 10 * len(b) for a, b in zip(completions1, completions2)]

    assert call(reward).tolist() == [21.0, 12.0, 43.0]
    assert seen == [([a], [b]) for a, b in zip(C1, C2)]  # CoMLRL 1.4.3's call: one-element lists


def test_a_batched_reward_gets_every_joint_action_of_an_item_at_once():
    seen = []

    @batched_reward
    def reward(completions1, completions2, *, batch_items, prompts):
        seen.append((completions1, completions2, batch_items, prompts))
        return [len(a) + 10 * len(b) for a, b in zip(completions1, completions2)]

    assert reward.reward_batched is True
    assert call(reward).tolist() == [21.0, 12.0, 43.0]
    assert seen == [(C1, C2, [ITEM] * 3, [PROMPT] * 3)]  # rows and prompts aligned with the completions


def test_prompts_and_items_are_aligned_with_the_completions():
    def leading(prompts, completions1, completions2):
        assert prompts == [PROMPT] and len(completions1) == 1
        return [1.0]

    def keywords(completions1, completions2, *, batch_items, prompts):
        assert batch_items == [ITEM] and prompts == [PROMPT]
        return [2.0]

    def kwargs_only(completions1, completions2, **kwargs):
        assert kwargs["batch_items"] == [ITEM] and kwargs["prompts"] == [PROMPT]
        return [3.0]

    joined = []

    def joint(lists):  # one positional parameter, two agents: a list of the lists
        joined.append(lists)
        return [4.0]

    def varargs(*completions, batch_items=None, prompts=None):  # keywords arrive, *args or not
        assert batch_items == [ITEM] and prompts == [PROMPT] and len(completions) == 2
        return [5.0]

    assert call(leading).tolist() == [1.0] * 3
    assert call(keywords).tolist() == [2.0] * 3
    assert call(kwargs_only).tolist() == [3.0] * 3
    assert call(joint).tolist() == [4.0] * 3 and joined == [[[a], [b]] for a, b in zip(C1, C2)]
    assert call(varargs).tolist() == [5.0] * 3


def test_named_keyword_parameters_are_never_taken_for_completions():
    """CoMLRL 1.4.3 counts ``batch_items=None`` as a third positional parameter, hands the prompts
    to ``completions1`` and then silently drops the rows; here they arrive."""
    def reward(completions1, completions2, batch_items=None):
        assert completions1 in ([c] for c in C1) and batch_items == [ITEM]
        return [1.0]

    def scaled(completions1, completions2, scale=2.0):
        assert completions1 in ([c] for c in C1)
        return [scale]

    assert call(reward).tolist() == [1.0] * 3
    assert call(scaled).tolist() == [2.0] * 3
    assert plan_reward_call(reward, 2).keywords == {"batch_items"} and not plan_reward_call(reward, 2).leading_prompts


def test_varargs_and_numpy_and_tensor_returns():
    assert call(lambda *cs: np.array([len(cs[0][0])])).tolist() == [1.0, 2.0, 3.0]
    assert call(lambda a, b: torch.tensor([0.5])).tolist() == [0.5] * 3
    assert call(batched_reward(lambda *cs: np.array([1, 2, 3]))).tolist() == [1.0, 2.0, 3.0]


def test_processor_is_applied_and_checked():
    assert call(lambda a, b: [len(a[0])], processor=lambda r: r * 10).tolist() == [10.0, 20.0, 30.0]
    with pytest.raises(RewardError, match="reward_processor.*finite"):
        call(lambda a, b: [1], processor=lambda r: math.inf)


@pytest.mark.parametrize("returned, words", [
    ([1.0, 2.0], "returned 2 value.s. for 3 joint action"),
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
        call(batched_reward(lambda a, b: returned))


def test_a_per_joint_action_reward_returning_a_list_is_told_how_to_batch():
    with pytest.raises(RewardError, match=r"returned 3 value.s. for 1 joint action.s. of one call; it is called once "
                                          r"per joint action .*comlrl.utils.batched_reward"):
        call(lambda a, b: [1.0, 2.0, 3.0])


def test_a_raising_reward_is_wrapped_with_its_name():
    def exploding_reward(completions1, completions2):
        raise KeyError("boom")

    with pytest.raises(RewardError, match="exploding_reward raised KeyError") as info:
        call(exploding_reward)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_reward_failing_with_a_key_in_its_message_never_shows_it():
    """A reward calling an API fails with the key in the text: the message and every traceback
    hide it (issue 29); a clean message keeps its cause (above)."""
    import traceback

    key = "sk-proj-" + "k" * 32

    def api_reward(completions1, completions2):
        raise RuntimeError(f"401 from https://judge.example/score?api_key={key}: bad key {key}")

    with pytest.raises(RewardError, match="api_reward raised RuntimeError: 401 from") as info:
        call(api_reward)
    shown = "".join(traceback.format_exception(info.value))
    assert key not in shown and "<redacted>" in str(info.value)
    assert info.value.original.args[0].endswith(key)  # kept for the program, never printed


def test_a_type_error_inside_the_reward_is_not_retried():
    """CoMLRL 1.4.3 calls the function a second time without keywords on any TypeError."""
    calls = []

    def reward(completions1, completions2, *, batch_items):
        calls.append(batch_items)
        raise TypeError("a bug inside the reward")

    with pytest.raises(RewardError, match="a bug inside the reward"):
        call(reward)
    assert calls == [[ITEM]]
    with pytest.raises(TypeError, match="a bug inside the reward"):  # the public helper: the user's own error
        call_reward_function(reward, [PROMPT], [C1, C2], num_agents=2, batch_items=[ITEM])
    assert len(calls) == 2


def test_wrong_arity_is_refused_up_front():
    with pytest.raises(RewardError, match="cannot take the completions of 2 agent"):
        RewardFunction(lambda a, b, c, d: [1.0], num_agents=2)
    with pytest.raises(RewardError, match="callable"):
        RewardFunction("not a function", num_agents=2)
    with pytest.raises(RewardError, match="reward_batched must be True or False"):
        RewardFunction(type("R", (), {"reward_batched": "yes", "__call__": lambda self, a, b: [0.0]})(), 2)


def test_public_helper_is_the_engines_binding():
    """comlrl.utils.call_reward_function: one call with the lists as given, read as the trainers read
    the signature (``batch_items=None`` is a keyword, not a third list)."""
    def two(a, b):
        return (1, 2)

    def rows(a, b, batch_items=None):
        return [float(r["id"]) for r in batch_items]

    assert call_reward_function(two, ["p"], [["x"], ["y"]], num_agents=2) == [1.0, 2.0]
    assert call_reward_function(lambda p, a, b: 5, ["p"], [["x"], ["y"]], num_agents=2) == [5.0]
    assert call_reward_function(rows, ["p", "q"], [C1[:2], C2[:2]], num_agents=2,
                                batch_items=[{"id": 3}, {"id": 4}]) == [3.0, 4.0]


@pytest.mark.parametrize("batched", [False, True])
def test_a_one_parameter_reward_is_told_it_gets_one_list_per_agent(batched):
    """def r(completions) of 2 agents receives [c1, c2]; scoring it as one list of completions gives
    one value per agent, and the error says why (issue 31)."""
    def lengths(completions):
        return [float(len(c)) for c in completions]

    func = batched_reward(lengths) if batched else lengths
    with pytest.raises(RewardError) as raised:
        call(func)
    message = str(raised.value)
    assert "returned 2 value(s) for" in message
    assert "receives a single argument: a list of 2 lists, one list of completions per agent" in message
    assert "def lengths(completions1, completions2)" in message
    with pytest.raises(RewardError) as two_lists:  # a two-parameter reward that miscounts gets no such hint
        call(lambda a, b: [1.0] * 5)
    assert "one positional parameter" not in str(two_lists.value)
