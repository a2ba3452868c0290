import random

import pytest
import torch

from comlrl import ConfigError, DataError, TransitionError
from comlrl.engine.episode import ExternalTransition, Node
from comlrl.engine.prompts import render_prompt
from comlrl.functional.returns import discounted_returns, tree_size

from helpers import length_ratio_reward, play


def slow_returns(rewards, children, joint, gamma, turns):
    def value(t, j):
        child = children[t][j]
        if child is None:  # ended: the reward stands for every remaining turn (absorbing state)
            return float(rewards[t][j]) * sum(gamma ** i for i in range(turns - t))
        kids = [value(t + 1, child * joint + i) for i in range(joint)]
        return float(rewards[t][j]) + gamma * sum(kids) / len(kids)
    return [[value(t, j) for j in range(len(rewards[t]))] for t in range(len(rewards))]


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("joint, turns", [(2, 3), (3, 2), (4, 1)])
def test_discounted_returns_match_recursion(gamma, joint, turns):
    rng = random.Random(joint * 7 + turns)
    rewards, children, nodes = [], [], 2
    for t in range(turns):
        rewards.append(torch.tensor([rng.uniform(-1, 1) for _ in range(nodes * joint)], dtype=torch.float64))
        kids, count = [], 0
        for _ in range(nodes * joint):
            if t + 1 < turns and rng.random() < 0.7:  # some branches end early
                kids.append(count)
                count += 1
            else:
                kids.append(None)
        children.append(kids)
        nodes = count
        if nodes == 0:
            break
    got = discounted_returns(rewards, children, joint, gamma, turns)
    want = slow_returns(rewards, children, joint, gamma, turns)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.tensor(w, dtype=torch.float64))


def test_ending_early_is_never_worth_less_than_finishing_late():
    # Solve at turn 1 (r=1, branch ends) vs 0.5 then a solve at turn 2, with gamma 0.9.
    early = discounted_returns([torch.tensor([1.0])], [[None]], 1, 0.9, num_turns=2)[0]
    late = discounted_returns([torch.tensor([0.5]), torch.tensor([1.0])], [[0], [None]], 1, 0.9, num_turns=2)[0]
    assert float(early) == pytest.approx(1.9) and float(late) == pytest.approx(1.4) and early > late


def test_tree_size():
    assert tree_size(1, 4) == (1, 4)
    assert tree_size(2, 4) == (5, 20)
    assert tree_size(3, 2) == (7, 14)


def _node():
    return Node(0, 0, (), ["p-a", "p-b"], [["p-a"], ["p-b"]], [[], []])


def test_transition_gets_the_coMLRL_keywords_it_declares():
    seen = {}

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        seen.update(locals())
        return [f"{prompt} | {c}" for c in agent_completions]

    out = ExternalTransition(transition, 2)(_node(), ["x", "y"], {"prompt": "p"}, 1)
    assert out == ["p | x", "p | y"]  # prompt: the task's own prompt field
    assert seen["num_agents"] == 2 and seen["prompt_history_per_agent"] == [["p-a"], ["p-b"]]
    assert seen["response_history_per_agent"] == [["x"], ["y"]]
    assert ExternalTransition(lambda agent_completions, **kw: ["a", "b"], 2)(_node(), ["x", "y"], {}, 1) == ["a", "b"]


@pytest.mark.parametrize("returned, words", [
    (["only one"], "list of 2 next prompts"),
    ("a string", "list of 2 next prompts"),
    (["ok", 3], "non-string prompt for agent 1"),
])
def test_bad_transition_outputs_are_named(returned, words):
    with pytest.raises(TransitionError, match=words):
        ExternalTransition(lambda agent_completions: returned, 2)(_node(), ["x", "y"], {}, 1)


def test_transition_errors():
    def broken(agent_completions):
        raise RuntimeError("no network")

    with pytest.raises(TransitionError, match="broken raised RuntimeError: no network"):
        ExternalTransition(broken, 2)(_node(), ["x", "y"], {}, 1)
    with pytest.raises(TransitionError, match="must accept agent_completions"):
        ExternalTransition(lambda a, b: ["x", "y"], 2)


def refine(prompt, agent_completions, turn):
    return [f"{prompt} Improve: {agent_completions[1][:20]}", f"{prompt} Lengthen: {agent_completions[0][:20]}"]


def test_two_turns_need_a_transition(make_trainer):
    with pytest.raises(ConfigError, match="num_turns=2 needs an external_transition"):
        make_trainer(num_turns=2)


def test_two_turn_episode_tree_rewards_and_env_step(make_trainer):
    calls = []

    def reward(completions1, completions2, prompts):
        calls.append(list(prompts))
        return length_ratio_reward(completions1, completions2)

    trainer = make_trainer(num_turns=2, num_train_epochs=1, reward_func=reward,
                           trainer_kwargs={"external_transition": refine})
    turns = play(trainer, [0])
    assert [len(t.nodes) for t in turns] == [1, 4] and [len(t.rewards) for t in turns] == [4, 16]
    assert turns[0].children == [0, 1, 2, 3] and turns[1].children == [None] * 16
    # turn-2 prompts are what the transition made of each turn-1 joint answer
    for j, node in enumerate(turns[1].nodes):
        assert node.path == (j,)
        assert node.prompts[1].endswith(turns[0].rollouts[0].texts[j][:20])
        assert node.response_history == [[turns[0].rollouts[0].texts[j]], [turns[0].rollouts[1].texts[j]]]
    # one reward call per joint action (4 per node), with agent 0's prompt of that turn
    assert calls[-16:] == [[n.prompts[0]] for n in turns[1].nodes for _ in range(4)]
    trainer.train()
    assert trainer.state.env_step == 4 * (4 + 16)


def test_later_prompts_go_through_the_formatters_unless_passed_through(make_trainer):
    """CoMLRL's convention: the transition's prompt replaces the task's ``prompt`` and goes through
    each agent's formatter (which may take ``external_prompts``); passthrough uses it as it is."""
    formatters = [lambda item: f"A: {item['prompt']}",
                  lambda item, external_prompts=None: f"B: {external_prompts or item['prompt']}"]
    for passthrough in (False, True):
        trainer = make_trainer(num_turns=2, external_prompt_passthrough=passthrough,
                               trainer_kwargs={"external_transition": refine, "formatters": formatters})
        turns = play(trainer, [0])
        first = turns[0].nodes[0].prompts
        assert first[0].startswith("A: ") and first[1].startswith("B: ")
        later = turns[1].nodes[0].prompts
        raw = refine(trainer._table("train").rows[0]["prompt"], [turns[0].rollouts[0].texts[0],
                                                                 turns[0].rollouts[1].texts[0]], 1)
        assert later == (raw if passthrough else [f"A: {raw[0]}", f"B: {raw[1]}"])


def test_an_empty_later_prompt_is_named(make_trainer):
    trainer = make_trainer(num_turns=2, trainer_kwargs={"external_transition": lambda agent_completions: ["", "x"]})
    with pytest.raises(DataError, match="agent 0 for turn 2 is empty"):
        trainer.train()


def test_early_termination_ends_nodes_whose_mean_reward_is_above_the_threshold(make_trainer):
    trainer = make_trainer(num_turns=2, reward_func=length_ratio_reward, trainer_kwargs={"external_transition": refine})
    means = play(trainer, [0, 1, 2, 3], threshold=None)[0].rewards.view(4, 4).mean(dim=1)
    threshold = float(means.median())
    turns = play(trainer, [0, 1, 2, 3], threshold=threshold)
    ended = (means > threshold).tolist()
    assert any(ended) and not all(ended)
    assert len(turns[1].nodes) == 4 * ended.count(False)
    assert [c is None for c in turns[0].children] == [e for e in ended for _ in range(4)]


def test_discount_is_applied_in_training(make_trainer):
    trainer = make_trainer(num_turns=2, discount=0.5, trainer_kwargs={"external_transition": refine})
    turns = play(trainer, [1])
    returns = discounted_returns([t.rewards for t in turns], [t.children for t in turns], 4, 0.5, 2)
    child_means = turns[1].rewards.view(4, 4).mean(dim=1)
    torch.testing.assert_close(returns[0], turns[0].rewards + 0.5 * child_means)


def test_multi_turn_resume_is_bit_exact(make_trainer, tmp_path):
    kwargs = dict(num_turns=2, max_new_tokens=8, trainer_kwargs={"external_transition": refine})
    full = make_trainer(num_train_epochs=2, **kwargs)
    full.train(checkpoint_dir=tmp_path / "full")
    make_trainer(num_train_epochs=1, **kwargs).train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=2, **kwargs)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-1", checkpoint_dir=tmp_path / "part")
    for a, b in zip(full.agents, resumed.agents):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_failing_transition_stops_before_any_update(make_trainer):
    def flaky(agent_completions):
        raise ValueError("bad state")

    trainer = make_trainer(num_turns=2, trainer_kwargs={"external_transition": flaky})
    before = [p.detach().clone() for m in trainer.agents for p in m.parameters()]
    with pytest.raises(TransitionError, match="bad state"):
        trainer.train()
    assert all(torch.equal(a, p) for a, p in zip(before, (p for m in trainer.agents for p in m.parameters())))


def test_cross_mode_two_turns(make_trainer):
    trainer = make_trainer(num_turns=2, joint_mode="cross", num_generations=2, num_train_epochs=1,
                           trainer_kwargs={"external_transition": refine})
    trainer.train()
    assert trainer.state.env_step == 4 * (4 + 16)  # J = K**N = 4 joint actions per node, 1 + 4 nodes


def test_chat_agents_render_every_turn_once(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from comlrl.testing import build_tiny_tokenizer

    from helpers import TEST_SETTINGS

    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    seen = []

    def transition(prompt, agent_completions):
        seen.append(prompt)
        return ["Go on.", "Go on."]

    trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                            tokenizer=tok, reward_func=length_ratio_reward, external_transition=transition,
                            train_dataset=[{"prompt": [{"role": "user", "content": "Hi."}]}],
                            args=MAGRPOConfig(**dict(TEST_SETTINGS, num_turns=2, max_new_tokens=4,
                                                     output_dir=str(tmp_path))))
    turns = play(trainer, [0])
    assert seen[0] == [{"role": "user", "content": "Hi."}]  # the transition sees the messages, not markup
    assert render_prompt(tok, turns[1].nodes[0].prompts[0], chat=True) == "<|user|>Go on.\n<|assistant|>"
