import itertools

import pytest
import torch

from comlrl.engine.collect import train_seeds

from comlrl import ConfigError
from comlrl.functional.joint import cross_combinations, cross_returns, joint_actions_per_group
from comlrl.utils import batched_reward


def slow_cross_returns(rewards, k, n):
    groups = rewards.shape[0]
    combos = list(itertools.product(range(k), repeat=n))
    out = torch.zeros(n, groups * k, dtype=rewards.dtype)
    for agent in range(n):
        for g in range(groups):
            for c in range(k):
                values = [rewards[g, j] for j, combo in enumerate(combos) if combo[agent] == c]
                out[agent, g * k + c] = sum(values) / len(values)
    return out


@pytest.mark.parametrize("k, n, groups", [(2, 1, 3), (3, 2, 2), (2, 3, 2), (4, 2, 1)])
def test_cross_returns_match_the_slow_reference(k, n, groups):
    rewards = torch.randn(groups, k ** n, generator=torch.Generator().manual_seed(k * 10 + n), dtype=torch.float64)
    torch.testing.assert_close(cross_returns(rewards, k, n), slow_cross_returns(rewards, k, n))


def test_cross_combinations_and_counts():
    combos = cross_combinations(3, 2)
    assert combos.shape == (9, 2) and combos[:4].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert joint_actions_per_group("aligned", 4, 3) == 4 and joint_actions_per_group("cross", 4, 3) == 64


@pytest.mark.parametrize("batched", [False, True], ids=["per-joint-action", "batched"])
def test_cross_mode_scores_every_combination(make_trainer, batched):
    calls = []

    def reward(completions1, completions2):
        calls.append((list(completions1), list(completions2)))
        return [float(len(a) - len(b)) for a, b in zip(completions1, completions2)]

    trainer = make_trainer(num_train_epochs=1, joint_mode="cross", num_generations=3,
                           reward_func=batched_reward(reward) if batched else reward, train_batch_size=2)
    table = trainer._table("train")
    (turn,) = trainer._collector(table).play(trainer._batch(table, [0, 1]), num_generations=3, num_turns=1,
                                             seed_of=train_seeds(trainer.args.seed, 0), threshold=None)
    rollouts, rewards = turn.rollouts, turn.rewards
    assert rewards.shape == (2 * 9,)
    if batched:  # one reward call per task item, with its 9 joint actions
        assert len(calls) == 2
    else:  # one call per joint action (CoMLRL 1.4.3's), one-element lists, in the same order
        assert len(calls) == 18 and all(len(a) == len(b) == 1 for a, b in calls)
        calls = [([a[0] for a, _ in calls[g * 9:(g + 1) * 9]], [b[0] for _, b in calls[g * 9:(g + 1) * 9]])
                 for g in range(2)]
    for g in range(2):
        first, second = calls[g]
        for j, (i0, i1) in enumerate(itertools.product(range(3), repeat=2)):
            assert first[j] == rollouts[0].texts[g * 3 + i0]
            assert second[j] == rollouts[1].texts[g * 3 + i1]
    returns = trainer._agent_returns(rewards, 2)
    torch.testing.assert_close(torch.stack(returns), slow_cross_returns(rewards.view(2, 9), 3, 2))
    trainer.train()
    assert trainer.state.env_step == 4 * 9  # 4 prompts x K**N joint actions


def test_cross_mode_growth_is_guarded_up_front(make_trainer):
    with pytest.raises(ConfigError, match=r"score up to 64 joint actions per prompt \(64 per node.*above max_joint_actions=50"):
        make_trainer(num_agents=3, reward_func=lambda a, b, c: [0.0] * len(a), joint_mode="cross",
                     num_generations=4, max_joint_actions=50)
