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


@pytest.mark.parametrize("kind", ["iac", "iac-shared", "maac"])
def test_actor_critic_agents_learn_the_seed_task(model_path, tokenizer, tmp_path, kind):
    """IAC (separate critics, or value heads on the agents) and MAAC from a random tiny model with
    one sample per prompt (the actor-critic default: the critic is the only baseline), the 4 seed
    prompts x 4 per epoch, 4 per optimizer step, lr 1e-3, 40 epochs. Measured, last 4 epochs, seeds
    0/1/2: iac 0.977 / 0.952 / 0.906, iac-shared 0.988 / 1.000 / 0.987, maac 0.976 / 0.988 / 0.979
    (1 thread); first epoch 0.36-0.40. (With K=4 samples of one prompt per step,
    standardising the advantages removes the prompt's value: that setting would not test the critic.)"""
    from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        settings = dict(num_turns=1, num_generations=1, num_train_epochs=40, max_new_tokens=64,
                        rollout_buffer_size=4, agent_learning_rate=1e-3, critic_learning_rate=1e-3, eval_interval=0,
                        temperature=1.0, top_p=1.0, top_k=50, weight_decay=0.0, max_grad_norm=1.0, shuffle=True,
                        early_termination_threshold=None, seed=seed, output_dir=str(out))
        common = dict(agent_model=model_path, tokenizer=tokenizer, reward_func=length_ratio_reward,
                      train_dataset=[{"prompt": p} for p in SEED_PROMPTS] * 4)
        if kind == "maac":
            trainer = MAACTrainer(critic_model=model_path, args=MAACConfig(**settings), **common)
        elif kind == "iac":
            trainer = IACTrainer(critic_model=model_path, args=IACConfig(**settings), **common)
        else:
            trainer = IACTrainer(args=IACConfig(use_separate_critic=False, **settings), **common)
        trainer.train()
        results.append(first_and_last(out))
    print(f"\n{kind}, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)
    assert statistics.median(last for _, last in results) >= 0.9
    assert min(last for _, last in results) >= 0.8


def test_maac_learns_the_two_turn_refinement_task(model_path, tokenizer, tmp_path):
    """examples/multi_turn_refine.py's task (writer drafts, editor 2-3x longer; then the writer
    rewrites its draft 2-3x longer) with MAAC: one sample per prompt and turn, the critic's value of
    the turn-2 state as the turn-1 bootstrap. 32 rows per epoch (the 4 prompts x 8), lr 2e-3,
    50 epochs. Measured, last 3 epochs (turn 1, turn 2), seeds 0/1/2: (0.954, 0.948),
    (0.887, 0.875), (0.942, 0.889); first epoch 0.37-0.42. (At lr 1e-3 seed 2 stays at 0.37 on
    turn 2 even after 80 epochs: the writer's short turn-1 drafts come first, and the rewrite
    needs them.)"""
    import importlib.util
    from pathlib import Path

    from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

    spec = importlib.util.spec_from_file_location(
        "multi_turn_refine", Path(__file__).parents[1] / "examples" / "multi_turn_refine.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    prompts = ["Describe a city in the clouds:", "Invent a new holiday:", "Write a bedtime story for a dragon:",
               "Design a playground on Mars:"]
    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        trainer = MAACTrainer(
            agent_model=model_path, critic_model=model_path, tokenizer=tokenizer, reward_func=example.refine_reward,
            external_transition=example.transition, train_dataset=[{"prompt": p} for p in prompts] * 8,
            args=MAACConfig(num_turns=2, discount=0.9, num_generations=1, max_new_tokens=32, num_train_epochs=50,
                            agent_learning_rate=2e-3, critic_learning_rate=2e-3, temperature=1.0, top_p=1.0,
                            early_termination_threshold=None, rollout_buffer_size=4, max_grad_norm=1.0,
                            eval_interval=0, external_prompt_passthrough=True, shuffle=True, weight_decay=0.0,
                            seed=seed, output_dir=str(out)))
        trainer.train()
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        per_epoch = len(rows) // 50

        def mean(part, key):
            return sum(r[key] for r in part) / len(part)

        results.append(tuple(round(mean(part, f"turn_{t}/reward_mean"), 3)
                             for part in (rows[:per_epoch], rows[-3 * per_epoch:]) for t in (1, 2)))
    print("\nMAAC two turns, per seed (first epoch turn 1, turn 2, last 3 epochs turn 1, turn 2):", results)
    assert all(r[0] < 0.5 and r[1] < 0.5 for r in results)  # a random model: far from the task
    for t in (2, 3):  # last epochs, turn 1 and turn 2
        assert statistics.median(r[t] for r in results) >= 0.8
        assert min(r[t] for r in results) >= 0.7
