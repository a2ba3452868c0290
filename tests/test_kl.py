"""Reference KL penalty (CoMLRL's: each completion's return minus reference_kl_coef times its KL to the
agent's initial policy): the pure function against loops, and in training (zero at the start,
restrains drift, never checkpointed, resumes bit-exactly, refuses another reference)."""

import math

import pytest
import torch

from comlrl import MAGRPOConfig, ResumeMismatchError
from comlrl.exceptions import ConfigError
from comlrl.functional import aggregate_tokens, policy_gradient_loss, sequence_kl

from helpers import assert_bit_exact, rows, state_of


def slow_kl(logp, ref, mask, estimator):
    def term(r, t):
        d = ref[r, t] - logp[r, t]
        return -d if estimator == "k1" else math.exp(d) - d - 1
    return [sum(term(r, t) for t in range(logp.shape[1]) if mask[r, t]) for r in range(logp.shape[0])]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sequence_kl_matches_a_loop(estimator):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[2] = False  # a row with nothing scored
    want = slow_kl(logp, ref, mask, estimator)
    logp[~mask] = float("nan")  # unscored positions must not leak
    got = sequence_kl(logp, ref, mask, estimator)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert got[2] == 0 and (estimator == "k1" or (got >= 0).all())


def test_log_ratio_penalty_has_the_kl_gradient():
    """Why the return is penalised with k1: E_pi[k1] = KL(pi || ref) and the REINFORCE gradient of
    the penalty, E[k1 * grad log pi], equals grad KL exactly; with k3 it does not (CoMLRL 1.4.3)."""
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1], dtype=torch.float64), dim=0)
    logp = torch.log_softmax(theta, dim=0)
    exact = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)[0]
    grads = {}
    for estimator in ("k1", "k3"):
        penalty = sequence_kl(logp.detach()[:, None], ref[:, None], torch.ones(3, 1, dtype=torch.bool), estimator)
        grads[estimator] = torch.autograd.grad((logp.exp().detach() * penalty * logp).sum(), theta,
                                               retain_graph=True)[0]
    torch.testing.assert_close(grads["k1"], exact)
    assert not torch.allclose(grads["k3"], exact)


def test_kl_is_zero_at_the_reference_and_carries_no_gradient():
    logp = torch.randn(3, 4, dtype=torch.float64).requires_grad_()
    kl = sequence_kl(logp, logp.detach(), torch.ones(3, 4, dtype=torch.bool))
    assert torch.equal(kl, torch.zeros(3, dtype=torch.float64)) and not kl.requires_grad


@pytest.mark.parametrize("loss_type", ["sequence", "grpo", "token_mean", "dr_grpo"])
def test_policy_loss_is_aggregate_of_its_per_token_terms(loss_type):
    logp, adv = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.4
    assert torch.equal(policy_gradient_loss(logp, adv, mask, loss_type, 6),
                       aggregate_tokens(-adv[:, None] * logp, mask, loss_type, 6))


def test_negative_coefficient_and_aliases_are_config_errors():
    with pytest.raises(ConfigError, match="reference_kl_coef"):
        MAGRPOConfig(reference_kl_coef=-0.1)
    with pytest.raises(ConfigError, match="did you mean 'reference_kl_coef'"):
        MAGRPOConfig(beta=0.1)
    with pytest.raises(ConfigError, match="reference_devices length"):
        MAGRPOConfig(num_agents=2, reference_kl_enabled=True, reference_devices=["cpu", "cpu", "cpu"])


def test_kl_starts_at_zero_and_restrains_drift(make_trainer, tmp_path):
    """A negligible coefficient only measures the KL; a strong one holds it down (same seed)."""
    last_kl = {}
    for name, coef in (("free", 1e-9), ("held", 2.0)):
        trainer = make_trainer(num_train_epochs=6, reference_kl_enabled=True, reference_kl_coef=coef)
        trainer.train(checkpoint_dir=tmp_path / name)
        logged = rows(tmp_path / name)
        assert logged[0]["agent_0/reference_kl"] == 0.0 and logged[0]["agent_1/reference_kl"] == 0.0
        assert all(r["agent_0/reference_kl"] != 0 for r in logged[1:])
        last_kl[name] = [sum(r[f"agent_{a}/reference_kl"] for r in logged[-8:]) / 8 for a in range(2)]
    # Measured: held / free = 0.63 (agent 0) over the last two epochs.
    for a in range(2):
        assert last_kl["held"][a] < 0.8 * last_kl["free"][a], last_kl
    # The reference stays the initial policy: frozen, no gradient, not in any checkpoint.
    assert len(trainer.reference_models) == 2
    assert all(not p.requires_grad for ref in trainer.reference_models for p in ref.parameters())
    assert sorted(p.name for p in (tmp_path / "held" / "checkpoint-3").rglob("model.safetensors")) == \
        ["model.safetensors"] * 2


def test_resume_with_kl_is_bit_exact_and_checks_the_reference(make_trainer, tmp_path):
    kl = dict(reference_kl_enabled=True, reference_kl_coef=0.5)
    full = make_trainer(num_train_epochs=4, **kl)
    full.train(checkpoint_dir=tmp_path / "full")
    first = make_trainer(num_train_epochs=2, **kl)
    first.train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=4, **kl)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")
    # Built from other initial weights, the reference would differ: refused by name.
    other = make_trainer(num_train_epochs=4, **kl)
    with torch.no_grad():
        for ref in other.reference_models:
            next(ref.parameters()).add_(0.01)
    other._fingerprint_cache = None
    with pytest.raises(ResumeMismatchError, match="references"):
        other.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")
