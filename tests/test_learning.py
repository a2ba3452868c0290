"""A random tiny model learns the seed task (agent 2 answers 2-3x longer than agent 1)."""

import json

import pytest


def test_agents_learn_the_seed_task(make_trainer, tmp_path):
    # The seed config (num_generations=4, max_new_tokens=64) with defaults otherwise, at lr 1e-3.
    trainer = make_trainer(num_train_epochs=40, max_new_tokens=64, agent_learning_rate=1e-3,
                           output_dir=str(tmp_path / "learn"))
    trainer.train()
    rewards = [json.loads(line)["train/reward_mean"] for line in open(tmp_path / "learn" / "metrics.jsonl")]
    assert len(rewards) == 160
    first, last = sum(rewards[:4]) / 4, sum(rewards[-16:]) / 16
    print(f"\nmean reward of the agents' own samples: first epoch {first:.3f}, last 4 epochs {last:.3f}")
    assert first == pytest.approx(0.4, abs=0.08)  # a random model: both answers ~64 tokens, ratio ~1
    assert last >= 0.9


def test_lora_agents_learn_the_seed_task(model_path, tokenizer, tmp_path):
    """The same task and threshold with LoRA agents (r=8, all linear layers) on one frozen base."""
    from peft import LoraConfig

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

    trainer = MAGRPOTrainer(
        agent_model=model_path, num_agents=2, tokenizer=tokenizer, reward_func=length_ratio_reward,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=MAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": 40, "max_new_tokens": 64,
                             "agent_learning_rate": 5e-3, "output_dir": str(tmp_path / "learn")}),
    )
    trainer.train()
    rewards = [json.loads(line)["train/reward_mean"] for line in open(tmp_path / "learn" / "metrics.jsonl")]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-16:]) / 16
    print(f"\nLoRA agents, mean reward: first epoch {first:.3f}, last 4 epochs {last:.3f}")
    assert first == pytest.approx(0.4, abs=0.08)
    assert last >= 0.9
