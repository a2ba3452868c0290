"""Reference KL penalty: the pure function against loops, and in training (zero at the start,
restrains drift, never checkpointed, resumes bit-exactly, refuses another reference)."""

import math

import pytest
import torch

from comlrl import MAGRPOConfig, ResumeMismatchError
from comlrl.exceptions import ConfigError
from comlrl.losses import aggregate_tokens, kl_penalty, policy_gradient_loss

from test_checkpoint import assert_bit_exact, rows, state_of


def slow_kl(logp, ref, mask, loss_type, max_new_tokens):
    rows_, per_row, total, count = logp.shape[0], [], 0.0, 0
    for r in range(rows_):
        values = [math.exp(ref[r, t] - logp[r, t]) - (ref[r, t] - logp[r, t]) - 1
                  for t in range(logp.shape[1]) if mask[r, t]]
        per_row.append(sum(values) / max(len(values), 1))
        total += sum(values)
        count += len(values)
    if loss_type == "grpo":
        return sum(per_row) / rows_
    if loss_type == "token_mean":
        return total / max(count, 1)
    return total / (rows_ * max_new_tokens)


@pytest.mark.parametrize("loss_type", ["grpo", "token_mean", "dr_grpo"])
def test_kl_penalty_matches_a_loop(loss_type):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # a row with nothing scored
    logp[~mask] = float("nan")  # unscored positions must not leak
    got = kl_penalty(logp, ref, mask, loss_type, max_new_tokens=7)
    assert float(got) == pytest.approx(float(slow_kl(logp, ref, mask, loss_type, 7)), rel=1e-12)
    assert float(got) >= 0


def test_unscored_positions_cannot_poison_the_gradient():
    logp = torch.tensor([[-1.0, -2.0, -200.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.1]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    kl_penalty(logp, ref, mask).backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0


def test_kl_is_zero_with_zero_gradient_at_the_reference():
    logp = torch.randn(3, 4, dtype=torch.float64).requires_grad_()
    kl = kl_penalty(logp, logp.detach(), torch.ones(3, 4, dtype=torch.bool))
    kl.backward()
    assert float(kl.detach()) == 0.0 and torch.count_nonzero(logp.grad) == 0


def test_policy_loss_is_aggregate_of_its_per_token_terms():
    logp, adv = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.4
    for loss_type in ("grpo", "token_mean", "dr_grpo"):
        assert torch.equal(policy_gradient_loss(logp, adv, mask, loss_type, 6),
                           aggregate_tokens(-adv[:, None] * logp, mask, loss_type, 6))


def test_negative_coefficient_is_a_config_error():
    with pytest.raises(ConfigError, match="reference_kl_coef"):
        MAGRPOConfig(reference_kl_coef=-0.1)
    with pytest.raises(ConfigError, match="did you mean 'reference_kl_coef'"):
        MAGRPOConfig(beta=0.1)


def test_kl_starts_at_zero_and_restrains_drift(make_trainer, tmp_path):
    """A negligible coefficient only measures the KL; a strong one holds it down (same seed)."""
    last_epoch_kl = {}
    for name, coef in (("free", 1e-9), ("held", 2.0)):
        trainer = make_trainer(num_train_epochs=3, reference_kl_coef=coef)
        trainer.train(checkpoint_dir=tmp_path / name)
        logged = rows(tmp_path / name)
        assert logged[0]["agent_0/kl"] == 0.0 and logged[0]["agent_1/kl"] == 0.0  # policy == reference
        assert all(r["agent_0/kl"] > 0 for r in logged[1:])
        last_epoch_kl[name] = [sum(r[f"agent_{a}/kl"] for r in logged[-4:]) / 4 for a in range(2)]
    for a in range(2):
        assert last_epoch_kl["held"][a] < 0.6 * last_epoch_kl["free"][a], last_epoch_kl
    # The reference stays the initial policy: frozen, no gradient, not in any checkpoint.
    assert all(not p.requires_grad for ref in trainer.references for p in ref.parameters())
    assert sorted(p.name for p in (tmp_path / "held" / "checkpoint-3").rglob("model.safetensors")) == \
        ["model.safetensors"] * 2


def test_resume_with_kl_is_bit_exact_and_checks_the_reference(make_trainer, tmp_path):
    full = make_trainer(num_train_epochs=4, reference_kl_coef=0.5)
    full.train(checkpoint_dir=tmp_path / "full")
    first = make_trainer(num_train_epochs=2, reference_kl_coef=0.5)
    first.train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=4, reference_kl_coef=0.5)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")
    # Built from other initial weights, the reference would differ: refused by name.
    other = make_trainer(num_train_epochs=4, reference_kl_coef=0.5)
    with torch.no_grad():
        for ref in other.references:
            next(ref.parameters()).add_(0.01)
    with pytest.raises(ResumeMismatchError, match="references"):
        other.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")
