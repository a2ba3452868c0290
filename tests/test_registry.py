"""Advantage estimators and policy losses registered by name (comlrl.extend's registries): a name
nobody registered is refused with the names that are, a registered one is selected by its name
(from a config too), and comlrl's own choices are registry entries whose values are unchanged."""

import pytest
import torch

from comlrl.exceptions import ConfigError
from comlrl.extend import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, MAGRPOConfig, PolicyLossSpec, Registry,
                           group_advantages, policy_gradient_loss, register_advantage, register_policy_loss)
from comlrl.functional import clipped_policy_loss


@pytest.fixture
def scratch_names():
    """Names a test registers, removed afterwards (the registries are process-wide)."""
    added = []
    yield added
    for registry, name in added:
        registry._entries.pop(name, None)
        registry._facts.pop(name, None)


def test_comlrl_registers_its_choices():
    assert ADVANTAGE_ESTIMATORS.names() == ("mean", "raw", "max", "rloo")
    assert set(POLICY_LOSSES.names()) >= {"reinforce", "clipped"}
    assert POLICY_LOSSES.facts("clipped") == {"ratio": True} and POLICY_LOSSES.facts("reinforce") == {"ratio": False}


def test_an_unknown_name_is_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'median'; registered: 'mean', 'raw', 'max', "
                                         r"'rloo'"):
        group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), "median")
    with pytest.raises(ValueError, match=r"unknown policy loss 'gspo'; registered: 'reinforce', 'clipped'"):
        PolicyLossSpec("gspo")
    with pytest.raises(ConfigError, match=r"advantage_mode must be one of 'mean', 'raw', 'max', 'rloo'"):
        MAGRPOConfig(advantage_mode="median")


def test_a_taken_name_is_refused_unless_replaced():
    registry = Registry("thing")
    first = registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="thing 'a' is registered already"):
        registry.register("a")(lambda: 2)
    assert registry.get("a") is first
    registry.register("a", replace=True)(second := lambda: 2)
    assert registry.get("a") is second and "a" in registry and list(registry) == ["a"]
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("")


def test_a_registered_estimator_is_selected_by_name_from_a_config(scratch_names):
    @register_advantage("median_test")
    def median(returns, groups):
        medians = torch.stack([returns[groups == g].median() for g in range(int(groups.max()) + 1)])
        return returns - medians[groups]
    scratch_names.append((ADVANTAGE_ESTIMATORS, "median_test"))

    returns = torch.tensor([1.0, 2.0, 10.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    expected = torch.tensor([-1.0, 0.0, 8.0, 0.0, 0.0, 3.0])
    assert torch.equal(group_advantages(returns, groups, "median_test"), expected)
    assert MAGRPOConfig(advantage_mode="median_test").advantage_mode == "median_test"


def test_a_registered_loss_is_what_a_spec_computes(scratch_names):
    calls = []

    @register_policy_loss("doubled_test", ratio=True)
    def doubled(log_probs, old, advantages, mask, spec, denominator):
        calls.append(old is not None)
        return 2 * policy_gradient_loss(log_probs, advantages, mask, spec.loss_type, denominator=denominator), None
    scratch_names.append((POLICY_LOSSES, "doubled_test"))

    logp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5])
    spec = PolicyLossSpec("doubled_test", "grpo")
    assert spec.uses_old_log_probs
    loss, clipped = spec(logp, logp, adv, mask, 6.0)
    assert clipped is None and calls == [True]
    assert torch.equal(loss, 2 * policy_gradient_loss(logp, adv, mask, "grpo", denominator=6.0))


@pytest.mark.parametrize("loss_type", ["sequence", "grpo", "token_mean", "dr_grpo"])
def test_the_built_in_losses_equal_the_functions_bit_for_bit(loss_type):
    gen = torch.Generator().manual_seed(1)
    logp, old = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    adv = torch.randn(4, generator=gen)
    plain, _ = PolicyLossSpec("reinforce", loss_type, 6)(logp, None, adv, mask, 5.0)
    assert torch.equal(plain, policy_gradient_loss(logp, adv, mask, loss_type, 6, denominator=5.0))
    ratio, clipped = PolicyLossSpec("clipped", loss_type, 6, 0.2)(logp, old, adv, mask, 5.0)
    expected = clipped_policy_loss(logp, old, adv, mask, 0.2, loss_type, 6, denominator=5.0)
    assert torch.equal(ratio, expected[0]) and torch.equal(clipped, expected[1])


def test_a_spec_refuses_an_unknown_loss_type():
    with pytest.raises(ValueError, match="unknown loss_type 'mean'"):
        PolicyLossSpec("reinforce", "mean")
    with pytest.raises(ValueError, match="needs max_new_tokens"):
        PolicyLossSpec("reinforce", "dr_grpo")
