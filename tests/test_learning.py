"""A random tiny model learns the seed task (agent 2 answers 2-3x longer than agent 1), full and as
LoRA agents. Several seeds each; the thresholds leave the headroom measured on this machine across
seeds, fused / unfused AdamW and 1 / 2 threads (numbers in each test)."""

import json
import statistics

import pytest

from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)


def first_and_last(path):
    rewards = [json.loads(line)["train/reward_mean"] for line in open(path / "metrics.jsonl")]
    return sum(rewards[:4]) / 4, sum(rewards[-16:]) / 16  # the first epoch; the last 4 epochs


def test_agents_learn_the_seed_task(make_trainer, tmp_path):
    # The seed config (num_generations=4, max_new_tokens=64) at lr 1e-3 with CoMLRL's advantage
    # normalisation. Measured, last 4 epochs: seeds 0/1/2 -> 0.994 / 0.992 / 0.995 (fused AdamW,
    # 1 thread); seed 0 unfused 0.994, seed 1 with 2 threads 0.992; first epoch 0.36-0.39.
    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        make_trainer(num_train_epochs=40, max_new_tokens=64, agent_learning_rate=1e-3, advantage_normalization=True,
                     seed=seed, output_dir=str(out)).train()
        results.append(first_and_last(out))
    print("\nfull agents, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)  # a random model: ratio ~1
    assert statistics.median(last for _, last in results) >= 0.9
    assert min(last for _, last in results) >= 0.8


def test_lora_agents_learn_the_seed_task(model_path, tokenizer, tmp_path):
    """The same task with LoRA agents (r=8, all linear layers) on one frozen base. Measured, last 4
    epochs: seeds 0/1/2 -> 0.979 / 0.998 / 0.847 (fused AdamW, 1 thread); seed 0 unfused 0.970,
    seed 2 with 2 threads 0.847."""
    from peft import LoraConfig

    from comlrl import MAGRPOConfig, MAGRPOTrainer

    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        trainer = MAGRPOTrainer(
            agent_model=model_path, num_agents=2, tokenizer=tokenizer, reward_func=length_ratio_reward,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
            train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
            args=MAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": 40, "max_new_tokens": 64, "seed": seed,
                                 "agent_learning_rate": 5e-3, "advantage_normalization": True,
                                 "output_dir": str(out)}))
        trainer.train()
        results.append(first_and_last(out))
    print("\nLoRA agents, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)
    assert statistics.median(last for _, last in results) >= 0.85
    assert min(last for _, last in results) >= 0.7
