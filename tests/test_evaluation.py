import json
import random

import pytest
import torch

from helpers import length_ratio_reward, rows

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
    assert set(first) == {"eval/reward_mean", "eval/reward_std", "eval/turn_1/reward_mean",
                          "eval/turn_1/expected_return", "eval/return_mean", "eval/agent_0/completion_length",
                          "eval/agent_1/completion_length"}
    assert 0 < first["eval/reward_mean"] <= 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
    assert torch.equal(state[0], torch.get_rng_state()) and state[1] == random.getstate()
    assert trainer.evaluate(num_eval_samples=1) != first


def test_evaluate_samples_one_completion_per_agent_and_item_and_calls_the_task_metric_callbacks(make_trainer):
    calls = {}

    def eval_logger(agent_completions_turns, batch_items, prompts):
        calls["logger"] = (agent_completions_turns, batch_items, prompts)
        return [{"turn_1/length": float(len(turns[0]))} for turns in agent_completions_turns[1]]

    def eval_aggregator(metrics, num_turns):
        calls["aggregator"] = num_turns
        return {"turn_1/mean_length": sum(m["turn_1/length"] for m in metrics) / len(metrics)}

    trainer = make_trainer(trainer_kwargs={"eval_dataset": EVAL, "eval_logger": eval_logger,
                                           "eval_aggregator": eval_aggregator})
    result = trainer.evaluate(num_eval_samples=2)
    completions, items, prompts = calls["logger"]
    assert len(completions) == 2 and all(len(agent) == 2 and len(agent[0]) == 1 for agent in completions)
    assert items == EVAL[:2] and prompts == [row["prompt"] for row in EVAL[:2]] and calls["aggregator"] == 1
    assert result["eval/turn_1/mean_length"] == sum(len(c[0]) for c in completions[1]) / 2


def test_training_with_evaluation_trains_the_same_weights(make_trainer, tmp_path):
    plain = make_trainer(reward_func=noisy_reward, output_dir=str(tmp_path / "plain"))
    plain.train()
    evaluated = make_trainer(reward_func=noisy_reward, eval_interval=3, output_dir=str(tmp_path / "eval"),
                             trainer_kwargs={"eval_dataset": EVAL})
    evaluated.train()
    assert all(torch.equal(a, b) for a, b in zip(weights(plain), weights(evaluated)))
    assert train_rows(tmp_path / "plain" / "metrics.jsonl") == train_rows(tmp_path / "eval" / "metrics.jsonl")
    logged = [json.loads(line) for line in open(tmp_path / "eval" / "metrics.jsonl")]
    # CoMLRL's cadence: before training prompts 0 and 3 of each epoch, logged at the env_step of that moment.
    assert [r["env_step"] for r in logged if "eval/reward_mean" in r] == [0, 12, 16, 28]


def test_evaluation_rows_and_the_logging_cadence(make_trainer, tmp_path):
    """Train rows once env_step moved logging_steps past the last one (the first always, and at
    the end of an epoch); every evaluation gets its own row, before the prompt it precedes."""
    trainer = make_trainer(num_train_epochs=1, logging_steps=8, eval_interval=1, output_dir=str(tmp_path / "o"),
                           trainer_kwargs={"eval_dataset": EVAL})
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    assert [(r["env_step"], "train/reward_mean" in r) for r in logged] == [
        (0, False), (4, True), (4, False), (8, False), (12, True), (12, False), (16, True)]


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
    assert rows(tmp_path / "full") == rows(tmp_path / "part")  # the eval row at the boundary once


def test_evaluation_without_a_dataset(make_trainer, caplog):
    make_trainer(eval_interval=5).train()  # CoMLRL's default eval_interval with no eval data: nothing to do
    assert make_trainer().evaluate() == {} and "without an eval_dataset" in caplog.text
    from comlrl import DataError

    with pytest.raises(DataError, match="eval_dataset row 0 has no 'prompt'"):
        make_trainer(trainer_kwargs={"eval_dataset": [{"q": "x"}]})
