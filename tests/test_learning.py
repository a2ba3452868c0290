"""A random tiny model learns the seed task (agent 2 answers 2-3x longer than agent 1), full and as
LoRA agents, with every trainer family. Several seeds each; the thresholds leave the headroom
measured across seeds and across the default / AVX2 / AVX-512 kernels (ATEN_CPU_CAPABILITY, see
../shared/tools/cpu-variants.sh), whose float results differ in the last bits and so send single
chaotic runs down different paths (numbers in each test)."""

import json
import statistics

import pytest

from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)


def first_and_last(path):
    rewards = [json.loads(line)["train/reward_mean"] for line in open(path / "metrics.jsonl")]
    return sum(rewards[:4]) / 4, sum(rewards[-16:]) / 16  # the first epoch; the last 4 epochs


def epoch_windows(path, width=10, rows_per_epoch=4):
    """(first epoch, last ``width`` epochs, best ``width``-epoch window): mean rewards of one run.

    Single actor-critic and LoRA runs are chaotic: a seed that learned can partly forget again, and
    which seed does so changes with the processor's float kernels. The best window says whether a
    run learned; the last one whether it stayed there; the tests assert on their means over seeds."""
    rewards = [json.loads(line)["train/reward_mean"] for line in open(path / "metrics.jsonl")]
    curve = [statistics.mean(rewards[e:e + rows_per_epoch]) for e in range(0, len(rewards), rows_per_epoch)]
    windows = [statistics.mean(curve[s:s + width]) for s in range(len(curve) - width + 1)]
    return curve[0], windows[-1], max(windows)


def assert_learned(results, label, best, last):
    """Means over the seeds of ``epoch_windows``' statistics: a random model gives 0.37-0.40."""
    print(f"\n{label}, per seed (first epoch, last 10 epochs, best 10 epochs):",
          [tuple(round(x, 3) for x in r) for r in results])
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _, _ in results)
    assert statistics.mean(b for _, _, b in results) >= best
    assert statistics.mean(l for _, l, _ in results) >= last


def test_agents_learn_the_seed_task(make_trainer, tmp_path):
    # The seed config (num_generations=4, max_new_tokens=64) at lr 1e-3 with CoMLRL's advantage
    # normalisation, 16 epochs. Measured, last 4 epochs, seeds 0/1/2: 0.987 / 0.991 / 0.985 on the
    # default and the AVX2 kernels alike, 0.987 / 0.968 / 0.985 on AVX-512; first epoch 0.36-0.41.
    # (At 20 epochs, as before: 0.973-0.991; the curves are flat from epoch 16.)
    _learns_the_seed_task(make_trainer, tmp_path, "full agents")


def bf16_attention_fails():
    """torch's error, if its bfloat16 CPU flash attention (the loss forward's, sequences >= 64) cannot
    run here: on a CPU with AVX512-BF16 / AMX but ATEN_CPU_CAPABILITY forced below AVX-512 (as
    ../shared/tools/cpu-variants.sh does), torch 2.13 picks the bf16 kernel by the CPU and then
    refuses it by the forced capability ("pack_vnni2 is only supported when avx512 is supported").
    A processor that really lacks AVX-512 takes another kernel, so this is torch's, not comlrl's."""
    import torch

    q = torch.zeros(1, 1, 64, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        if "pack_vnni2" in str(exc):
            return str(exc)
        raise
    return None


def test_agents_learn_the_seed_task_in_bf16(make_trainer, tmp_path):
    if (reason := bf16_attention_fails()) is not None:
        pytest.skip(f"torch cannot run bf16 attention under these forced kernels: {reason}")
    # mixed_precision="bf16" (sampling and the update on bf16 copies, fp32 masters and AdamW), the
    # same epochs and thresholds as in float32. Measured on an AMD EPYC with AVX512-BF16 (2026-12-06),
    # last 4 epochs, seeds 0/1/2, forced default / AVX2 / AVX-512 kernels: 0.993 / 0.989 / 0.975,
    # 0.991 / 0.966 / 0.991, 0.945 / 0.990 / 1.000; first epoch 0.36-0.39. (With the update under
    # autocast, an earlier AVX-512 machine: 0.980 / 0.971 / 0.979. Where torch's forced kernels cannot
    # run bf16 attention the test is skipped, see bf16_attention_fails.)
    _learns_the_seed_task(make_trainer, tmp_path, "full agents, bf16", mixed_precision="bf16")


def _learns_the_seed_task(make_trainer, tmp_path, label, **overrides):
    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        make_trainer(num_train_epochs=16, max_new_tokens=64, agent_learning_rate=1e-3, advantage_normalization=True,
                     seed=seed, output_dir=str(out), **overrides).train()
        results.append(first_and_last(out))
    print(f"\n{label}, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)  # a random model: ratio ~1
    assert statistics.median(last for _, last in results) >= 0.9
    assert min(last for _, last in results) >= 0.8


def test_lora_agents_learn_the_seed_task(model_path, tokenizer, tmp_path):
    """The same task with LoRA agents (r=8, all linear layers) on one frozen base, 40 epochs.
    Measured over seeds 0/1/2 on the default / AVX2 / AVX-512 kernels: 3-seed mean of the best
    10-epoch window 0.921 / 0.867 / 0.912, of the last 10 epochs 0.900 / 0.859 / 0.912 (single
    seeds 0.766-0.986); asserted >= 0.7 and >= 0.65 (a random model gives 0.37-0.40)."""
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
        results.append(epoch_windows(out))
    assert_learned(results, "LoRA agents", best=0.7, last=0.65)


@pytest.mark.parametrize("kind", ["iac", "iac-shared", "maac"])
def test_actor_critic_agents_learn_the_seed_task(model_path, tokenizer, tmp_path, kind):
    """IAC (separate critics, or value heads on the agents) and MAAC from a random tiny model with
    one sample per prompt (the actor-critic default: the critic is the only baseline), the 4 seed
    prompts x 4 per epoch, 4 per optimizer step, lr 1e-3, 40 epochs. (With K=4 samples of one prompt
    per step, standardising the advantages removes the prompt's value: that setting would not test
    the critic.)

    Single runs are chaotic: a seed that learned can partly forget again, and which seed does so
    changes with the float kernels (last 4 epochs of one iac seed: 0.94 on AVX-512, 0.66 on the
    default kernels). Measured over seeds 0/1/2 on the default / AVX2 / AVX-512 kernels (9 3-seed
    means per statistic), the 3-seed mean of the best 10-epoch window is 0.951-0.993 (single seeds
    >= 0.917) and of the last 10 epochs 0.810-0.993 (single seeds 0.479-1.0: one iac-shared seed on
    AVX2 learned, then forgot); asserted >= 0.8 and >= 0.6 (a random model gives 0.37-0.40)."""
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
        results.append(epoch_windows(out))
    assert_learned(results, kind, best=0.8, last=0.6)


def test_maac_learns_the_two_turn_refinement_task(model_path, tokenizer, tmp_path):
    """examples/multi_turn_refine.py's task (writer drafts, editor 2-3x longer; then the writer
    rewrites its draft 2-3x longer) with MAAC: one sample per prompt and turn, the critic's value of
    the turn-2 state as the turn-1 bootstrap. 32 rows per epoch (the 4 prompts x 8), lr 2e-3,
    35 epochs, seeds 0-2.

    Single runs are chaotic: a seed that learns on one processor's float kernels may stall on
    another's, and what is learned is sometimes partly forgotten (at 60 epochs the 4-seed mean of
    turn 1's last 10 epochs fell to 0.74 on the AVX2 kernels). So the test asserts on the best
    10-epoch window of each turn, averaged over the seeds. Measured on the three kernel families
    (default, AVX2, AVX-512), seeds 0-2, the 3-seed means of those windows:

    * 35 epochs (this test): turn 1 0.847-0.880, turn 2 0.712-0.765 (single seeds 0.726-0.962 and
      0.390-0.957); asserted >= 0.65 and >= 0.55;
    * 40 epochs (before): turn 1 0.866-0.901, turn 2 0.737-0.784; with a fourth seed 0.827-0.909
      and 0.729-0.774.

    Seed 3 and the last 5 epochs were dropped for the suite's time (about 75 s and 30 s); turn 2,
    the slower to learn, keeps 0.16 above its threshold.

    A random model starts at 0.36-0.41 in both turns (asserted < 0.5)."""
    import importlib.util
    from pathlib import Path

    from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

    spec = importlib.util.spec_from_file_location(
        "multi_turn_refine", Path(__file__).parents[1] / "examples" / "multi_turn_refine.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    prompts = ["Describe a city in the clouds:", "Invent a new holiday:", "Write a bedtime story for a dragon:",
               "Design a playground on Mars:"]
    epochs, results = 35, []
    for seed in (0, 1, 2):
        out = tmp_path / f"seed{seed}"
        trainer = MAACTrainer(
            agent_model=model_path, critic_model=model_path, tokenizer=tokenizer, reward_func=example.refine_reward,
            external_transition=example.transition, train_dataset=[{"prompt": p} for p in prompts] * 8,
            args=MAACConfig(num_turns=2, discount=0.9, num_generations=1, max_new_tokens=32,
                            num_train_epochs=epochs, agent_learning_rate=2e-3, critic_learning_rate=2e-3,
                            temperature=1.0, top_p=1.0, early_termination_threshold=None, rollout_buffer_size=4,
                            max_grad_norm=1.0, eval_interval=0, external_prompt_passthrough=True, shuffle=True,
                            weight_decay=0.0, seed=seed, output_dir=str(out)))
        trainer.train()
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        per_epoch = len(rows) // epochs
        curve = [[statistics.mean(r[f"turn_{t}/reward_mean"] for r in rows[e * per_epoch:(e + 1) * per_epoch])
                  for t in (1, 2)] for e in range(epochs)]

        def window(start, turn):
            return statistics.mean(c[turn] for c in curve[start:start + 10])

        results.append({"first": curve[0], "turn1_best10": max(window(start, 0) for start in range(epochs - 9)),
                        "turn2_best10": max(window(start, 1) for start in range(epochs - 9))})
    print("\nMAAC two turns, per seed:", [{k: (round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v])
                                          for k, v in r.items()} for r in results])
    assert all(r["first"][0] < 0.5 and r["first"][1] < 0.5 for r in results)  # a random model: far from the task
    assert statistics.mean(r["turn1_best10"] for r in results) >= 0.65
    assert statistics.mean(r["turn2_best10"] for r in results) >= 0.55


def _eval_reward(trainer):
    return trainer.evaluate()["eval/reward_mean"]


def test_madpo_learns_the_seed_task(model_path, tokenizer, tmp_path):
    """MADPO from a random tiny model: one pair set of the initial policy's candidates (16 per prompt,
    8 pairs kept per prompt), 20 DPO epochs at lr 3e-3. The reward of the agents' own samples on the
    seed prompts (32 evaluation rows, fixed seeds), before -> after, seeds 0/1/2: 0.373 -> 0.548,
    0.379 -> 0.495, 0.384 -> 0.492 (1 thread)."""
    from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

    gains = []
    for seed in SEEDS:
        trainer = MADPOTrainer(
            agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
            train_dataset=[{"prompt": p} for p in SEED_PROMPTS], eval_dataset=[{"prompt": p} for p in SEED_PROMPTS] * 8,
            args=MADPOConfig(num_train_epochs=20, preference_num_candidates=16, preference_pairs_per_sample=8,
                             max_new_tokens=32, agent_learning_rate=3e-3, temperature=1.0, top_p=1.0,
                             train_batch_size=4, eval_interval=0, logging_steps=1, eval_num_samples=None, seed=seed,
                             weight_decay=0.0, max_grad_norm=1.0, output_dir=str(tmp_path / f"seed{seed}")))
        before = _eval_reward(trainer)
        trainer.train()
        gains.append((before, _eval_reward(trainer)))
    print("\nMADPO, eval reward per seed (before, after):", gains)
    assert all(before == pytest.approx(0.38, abs=0.06) for before, _ in gains)
    assert statistics.median(after - before for before, after in gains) >= 0.06
    assert min(after - before for before, after in gains) >= 0.03


E_PROMPTS = ["Describe a city in the clouds:", "Invent a new holiday and explain it:",
             "Write a bedtime story for a dragon:", "Design a playground on Mars:", "Describe a quiet morning:",
             "Invent a game for two robots:", "Write a poem about the sea:", "Design a house for a cat:"]
HELD_OUT = ["Describe a market of light:", "Write a story about a fox:", "Invent a new sport:",
            "Design a garden on the moon:", "Describe a bridge of glass:", "Write a letter to a star:",
            "Invent a machine for rain:", "Design a boat for clouds:"]


def e_density(completions1, completions2):
    """How often the two agents write the letter e (x5, at most 1): a judge a reward model built on
    a random 64-wide backbone can learn from a few hundred pairs (the seed task's length ratio is
    beyond it: measured held-out accuracy 0.55-0.69, and the online phase did not improve)."""
    return [min(1.0, 5 * (a.count("e") + b.count("e")) / max(len(a) + len(b), 1))
            for a, b in zip(completions1, completions2)]


def test_marlhf_reward_model_generalises_and_its_online_phase_improves_the_task(model_path, tokenizer, tmp_path):
    """MARLHF (MAGRPO online phase) on the e-density task: the reward model ranks pairs of prompts
    it never saw better than chance, and training with it raises the TASK reward. 16 training rows
    (the 8 prompts twice: 256 training pairs), 5 epochs of the online phase, 512 held-out pairs of 8
    other prompts. Measured over seeds 0-5 on the default / avx2 / avx512 kernels (18 runs): held-out
    accuracy 0.54-0.82 (mean 0.67), task reward gain 0.08-0.43 (mean 0.27); 3-seed means of seeds 0-2:
    accuracy 0.70 / 0.70 / 0.73, gain 0.18 / 0.31 / 0.26. Single seeds vary a lot (a random 64-wide
    backbone), so the test asserts on the means over seeds 0-2: accuracy >= 0.58 (chance is 0.5) and
    gain >= 0.1 (a phase that does not learn gives 0), about 3 standard deviations of a 3-seed mean
    below the measured means."""
    from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

    results = []
    for seed in SEEDS:
        trainer = MARLHFTrainer(
            agent_model=str(model_path), tokenizer=tokenizer, reward_func=e_density,
            train_dataset=[{"prompt": p} for p in E_PROMPTS] * 2, eval_dataset=[{"prompt": p} for p in E_PROMPTS] * 4,
            args=MARLHFConfig(rl_algorithm="magrpo", num_train_epochs=5, preference_num_candidates=16,
                              preference_pairs_per_sample=16, max_new_tokens=32, agent_learning_rate=1e-3,
                              temperature=1.0, top_p=1.0, train_batch_size=2, rollout_buffer_size=2, eval_interval=0,
                              logging_steps=1, reward_model_device="cpu", num_generations=4,
                              reward_train_batch_size=8, reward_num_train_epochs=5, reward_learning_rate=1e-3,
                              eval_num_samples=None, seed=seed, weight_decay=0.0, max_grad_norm=1.0,
                              output_dir=str(tmp_path / f"seed{seed}")))
        before = _eval_reward(trainer)
        trainer.train()
        after = _eval_reward(trainer)
        held_out = trainer.preference_pairs([{"prompt": p} for p in HELD_OUT] * 4)
        results.append((trainer.reward_model_accuracy(held_out), before, after))
    print("\nMARLHF, per seed (held-out accuracy, task reward before, after):", results)
    assert statistics.mean(acc for acc, _, _ in results) >= 0.58
    assert statistics.mean(after - before for _, before, after in results) >= 0.1


@pytest.mark.parametrize("kind", ["clipped", "mahagrpo"])
def test_the_clipped_update_and_mahagrpo_learn_the_seed_task(model_path, tokenizer, tmp_path, kind):
    """MAGRPO's clipped-ratio update (ppo_clip_eps 0.2, 2 passes per buffer) and MAHAGRPO (sequential
    HAPPO-weighted updates) from a random tiny model, the seed config at lr 1e-3, 16 epochs. Measured,
    last 4 epochs, seeds 0-2 on the default / avx2 / avx512 kernels of an AMD EPYC with AVX512-BF16
    (2026-12-06, 9 runs each): at 16 epochs clipped 0.982-0.996, MAHAGRPO 0.951-1.000 (3-seed means
    0.976-0.995); at 20 epochs, as this test ran before, clipped 0.941-0.993, MAHAGRPO 0.991-0.996. An
    earlier AVX-512 machine gave, at 20 epochs, clipped 0.921-0.997 and MAHAGRPO 0.991-0.995, and at 40
    epochs (seeds 0-3) 0.943-1.000 and 0.990-0.998: the curves are flat from epoch 16. First epoch
    0.36-0.40. Asserted: mean over seeds 0-2 >= 0.85 and every seed >= 0.7 (the random model gives
    0.37)."""
    from comlrl.trainers.reinforce import MAHAGRPOConfig, MAHAGRPOTrainer
    from transformers import AutoModelForCausalLM

    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        settings = dict(TEST_SETTINGS, num_train_epochs=16, max_new_tokens=64, agent_learning_rate=1e-3,
                        advantage_normalization=True, seed=seed, output_dir=str(out))
        if kind == "clipped":
            from comlrl import MAGRPOConfig, MAGRPOTrainer

            cls, config = MAGRPOTrainer, MAGRPOConfig(**settings, ppo_clip_eps=0.2, num_update_epochs=2)
        else:
            cls, config = MAHAGRPOTrainer, MAHAGRPOConfig(**settings)
        cls(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)], tokenizer=tokenizer,
            reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=config).train()
        results.append(first_and_last(out))
    print(f"\n{kind}, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)
    assert statistics.mean(last for _, last in results) >= 0.85
    assert min(last for _, last in results) >= 0.7
