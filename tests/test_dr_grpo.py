"""Dr. GRPO (comlrl.algorithms.dr_grpo, written on comlrl.extend alone): its registered loss is
MAGRPO's ``loss_type="dr_grpo"`` without std normalisation, bit for bit; its config refuses the
normalisations the paper removes; a resumed run equals the uninterrupted one bit for bit; and a
random tiny model learns the seed task with it."""

import json
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl import ConfigError, MAGRPOConfig, MAGRPOTrainer
from comlrl.algorithms import DrGRPOConfig, DrGRPOTrainer
from comlrl.algorithms.dr_grpo import dr_grpo_loss
from comlrl.extend import PolicyLossSpec, policy_gradient_loss

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, rows, state_of

DR_SETTINGS = {k: v for k, v in TEST_SETTINGS.items() if k not in ("loss_type", "advantage_normalization")}


@pytest.fixture
def make_dr(model_path, tokenizer, tmp_path):
    def factory(cls=DrGRPOTrainer, config=DrGRPOConfig, **overrides):
        settings = dict(DR_SETTINGS, num_train_epochs=2, max_new_tokens=12, agent_learning_rate=1e-3,
                        output_dir=str(tmp_path / "out"))
        settings.update(overrides)
        return cls(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)], tokenizer=tokenizer,
                   reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                   args=config(**settings))
    return factory


def test_the_loss_divides_the_token_sum_by_a_constant():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    spec = PolicyLossSpec("dr_grpo", "dr_grpo", max_new_tokens=5)
    by_hand = -(adv[:, None] * logp * mask).sum() / (3 * 5)
    loss, clipped = dr_grpo_loss(logp, None, adv, mask, spec, None)
    assert clipped is None and float(loss) == pytest.approx(float(by_hand), rel=1e-6)
    assert torch.equal(loss, policy_gradient_loss(logp, adv, mask, "dr_grpo", 5))
    # a longer completion is not diluted: the gradient of each token's log-prob is -A / (R * max_new_tokens)
    logp.requires_grad_(True)
    dr_grpo_loss(logp, None, adv, mask, spec, None)[0].backward()
    assert torch.allclose(logp.grad, -(adv[:, None] * mask) / 15.0, rtol=0, atol=1e-7)


def test_the_config_refuses_the_normalisations_it_removes():
    assert DrGRPOConfig().loss_type == "dr_grpo" and DrGRPOConfig().advantage_normalization is False
    with pytest.raises(ConfigError, match="advantage_normalization=True"):
        DrGRPOConfig(advantage_normalization=True)
    with pytest.raises(ConfigError, match="loss_type must be one of 'dr_grpo'"):
        DrGRPOConfig(loss_type="grpo")


def test_a_magrpo_config_is_refused(make_dr):
    with pytest.raises(ConfigError, match="DrGRPOTrainer needs a DrGRPOConfig"):
        make_dr(config=MAGRPOConfig)


def test_it_trains_as_magrpo_with_the_dr_grpo_loss_type_bit_for_bit(make_dr, tmp_path):
    """The registered loss reaches the same weights as MAGRPO's built-in aggregation (the update
    path is the public one: the spec from policy_loss_spec, through policy_backward)."""
    dr = make_dr(num_train_epochs=1, output_dir=str(tmp_path / "dr"))
    assert dr.loss_spec.name == "dr_grpo"
    dr.train()
    plain = make_dr(MAGRPOTrainer, MAGRPOConfig, num_train_epochs=1, loss_type="dr_grpo",
                    advantage_normalization=False, output_dir=str(tmp_path / "plain"))
    plain.train()
    assert_bit_exact(state_of(dr), state_of(plain))


def test_resume_equals_uninterrupted_bit_exact(make_dr, tmp_path):
    full = make_dr(num_train_epochs=3, output_dir=str(tmp_path / "full"))
    full.train(checkpoint_dir=tmp_path / "full-ck")
    make_dr(num_train_epochs=1, output_dir=str(tmp_path / "part")).train(checkpoint_dir=tmp_path / "part-ck")
    resumed = make_dr(num_train_epochs=3, output_dir=str(tmp_path / "part"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "part-ck" / "checkpoint-1"), checkpoint_dir=tmp_path / "part-ck")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full-ck") == rows(tmp_path / "part-ck")
    state = json.loads((tmp_path / "part-ck" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["trainer"] == "DrGRPOTrainer" and state["counters"]["global_step"] == 12


@pytest.mark.slow
def test_dr_grpo_learns_the_seed_task(make_dr, tmp_path):
    """The seed config (num_generations 4, 32 new tokens) at lr 1e-3 from a random tiny model, 20
    epochs, 3 seeds. Measured, last 4 epochs, seeds 0/1/2, the same on the default / avx2 / avx512
    kernels (two machines): at 20 epochs 0.992 / 0.976 / 0.962; at 30, as this test ran before,
    0.993 / 0.959 / 0.973 (flat from epoch 18: 0.968-0.976); first epoch 0.36-0.42. Asserted: the
    random model's first epoch near 0.37, the median of the last 4 epochs >= 0.85 and every seed >=
    0.7."""
    results = []
    for seed in (0, 1, 2):
        out = tmp_path / f"seed{seed}"
        make_dr(num_train_epochs=EPOCHS, max_new_tokens=32, seed=seed, output_dir=str(out)).train()
        rewards = [json.loads(line)["train/reward_mean"] for line in open(out / "metrics.jsonl")]
        results.append((sum(rewards[:4]) / 4, sum(rewards[-16:]) / 16))
    print("\nDr. GRPO, mean reward per seed (first epoch, last 4 epochs):", results)
    assert all(first == pytest.approx(0.37, abs=0.08) for first, _ in results)
    assert statistics.median(last for _, last in results) >= 0.85
    assert min(last for _, last in results) >= 0.7


EPOCHS = 20
