import json
import random

import pytest
import torch

from comlrl import ConfigError

from helpers import length_ratio_reward

EVAL = [{"prompt": p} for p in ("Tell a joke about rain:", "Name three colours:", "Describe a quiet forest:")]


def noisy_reward(completions1, completions2):
    """Consumes Python's global random stream, as user rewards sometimes do."""
    return [r + 0.01 * random.random() for r in length_ratio_reward(completions1, completions2)]


def weights(trainer):
    return [p.detach().clone() for m in trainer.agents for p in m.parameters()]


def train_rows(path):
    rows = [json.loads(line) for line in open(path)]
    return [{k: v for k, v in r.items() if k.startswith(("train/", "agent_")) or k == "env_step"}
            for r in rows if "train/reward_mean" in r]


def test_evaluate_returns_metrics_and_changes_nothing(make_trainer):
    trainer = make_trainer(trainer_kwargs={"eval_dataset": EVAL})
    before = weights(trainer)
    state = torch.get_rng_state(), random.getstate()
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second  # the same eval seeds every time
    assert set(first) == {"eval/reward_mean", "eval/reward_std", "eval/turn_1/reward_mean", "eval/return_mean",
                          "eval/agent_0/completion_length", "eval/agent_1/completion_length"}
    assert 0 < first["eval/reward_mean"] <= 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert torch.equal(state[0], torch.get_rng_state()) and state[1] == random.getstate()
    assert trainer.evaluate(num_samples=1) != first


def test_training_with_evaluation_trains_the_same_weights(make_trainer, tmp_path):
    plain = make_trainer(reward_func=noisy_reward, output_dir=str(tmp_path / "plain"))
    plain.train()
    evaluated = make_trainer(reward_func=noisy_reward, eval_interval=3, output_dir=str(tmp_path / "eval"),
                             trainer_kwargs={"eval_dataset": EVAL})
    evaluated.train()
    assert all(torch.equal(a, b) for a, b in zip(weights(plain), weights(evaluated)))
    assert train_rows(tmp_path / "plain" / "metrics.jsonl") == train_rows(tmp_path / "eval" / "metrics.jsonl")
    rows = [json.loads(line) for line in open(tmp_path / "eval" / "metrics.jsonl")]
    eval_steps = [r["global_step"] for r in rows if "eval/reward_mean" in r]
    assert eval_steps == [3, 6] and len(rows) == 8  # merged into the train rows of those steps


def test_evaluation_only_rows_when_not_a_logging_step(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1, logging_steps=4, eval_interval=1, output_dir=str(tmp_path / "o"),
                           trainer_kwargs={"eval_dataset": EVAL})
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    assert [r["env_step"] for r in rows] == [4, 8, 12, 16]
    assert ["train/reward_mean" in r for r in rows] == [False, False, False, True]
    assert all("eval/reward_mean" in r for r in rows)


def test_resume_with_evaluation_is_exact(make_trainer, tmp_path):
    full = make_trainer(num_train_epochs=2, eval_interval=2, reward_func=noisy_reward,
                        trainer_kwargs={"eval_dataset": EVAL})
    full.train(checkpoint_dir=tmp_path / "full")
    make_trainer(num_train_epochs=1, eval_interval=2, reward_func=noisy_reward,
                 trainer_kwargs={"eval_dataset": EVAL}).train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=2, eval_interval=2, reward_func=noisy_reward,
                           trainer_kwargs={"eval_dataset": EVAL})
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-1", checkpoint_dir=tmp_path / "part")
    assert all(torch.equal(a, b) for a, b in zip(weights(full), weights(resumed)))


def test_evaluation_needs_a_dataset(make_trainer):
    with pytest.raises(ConfigError, match="no eval_dataset"):
        make_trainer(eval_interval=5)
    with pytest.raises(ConfigError, match="needs an eval_dataset"):
        make_trainer().evaluate()
    from comlrl import DataError

    with pytest.raises(DataError, match="eval_dataset row 0 has no 'prompt'"):
        make_trainer(trainer_kwargs={"eval_dataset": [{"q": "x"}]})
