"""The clipped-ratio update of the REINFORCE family (ppo_clip_eps, num_update_epochs) and MAHAGRPO
(sequential HAPPO-weighted updates): the loss against a slow reference, equivalences with MAGRPO,
no extra forward pass where the sampling policy's log-probs are at hand, exact resume."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl import ConfigError
from comlrl.functional.losses import clipped_policy_loss, policy_gradient_loss, sequence_ratio
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer, MAHAGRPOConfig, MAHAGRPOTrainer

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, rows, state_of


def slow_clipped_loss(logp, old, adv, mask, eps, loss_type):
    """The clipped surrogate token by token (GRPO as TRL computes it), for 'sequence' and 'grpo'."""
    total = 0.0
    for r in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[r, t]:
                continue
            ratio = math.exp(float(logp[r, t]) - float(old[r, t]))
            clipped = min(max(ratio, 1 - eps), 1 + eps) if eps is not None else ratio
            terms.append(-min(ratio * float(adv[r]), clipped * float(adv[r])))
        total += sum(terms) if loss_type == "sequence" else sum(terms) / max(len(terms), 1)
    return total / logp.shape[0]


@pytest.mark.parametrize("loss_type", ["sequence", "grpo"])
@pytest.mark.parametrize("eps", [0.2, None])
def test_clipped_loss_matches_the_reference(loss_type, eps):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.4  # ratios well outside the clip range
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0, -2.0], dtype=torch.float64)
    mask = torch.rand(5, 7, generator=gen) > 0.3
    loss, clipped = clipped_policy_loss(logp, old, adv, mask, eps, loss_type)
    assert float(loss) == pytest.approx(slow_clipped_loss(logp, old, adv, mask, eps, loss_type), rel=1e-12)
    if eps is None:
        assert not clipped.any()
    else:
        ratio = torch.exp(logp - old)
        held = ((adv.unsqueeze(1) > 0) & (ratio > 1 + eps)) | ((adv.unsqueeze(1) < 0) & (ratio < 1 - eps))
        assert torch.equal(clipped, held & mask)


def test_at_ratio_one_the_gradient_is_reinforces_exactly():
    gen = torch.Generator().manual_seed(1)
    base = -torch.rand(4, 6, generator=gen) * 2
    adv = torch.randn(4, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    grads = []
    for use_ratio in (False, True):
        logp = base.clone().requires_grad_(True)
        if use_ratio:
            loss, clipped = clipped_policy_loss(logp, logp.detach(), adv, mask, 0.2, "grpo")
            assert not clipped.any()
        else:
            loss = policy_gradient_loss(logp, adv, mask, "grpo")
        loss.backward()
        grads.append(logp.grad)
    assert torch.equal(grads[0], grads[1])


def test_sequence_ratio():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    assert float(sequence_ratio(logp, old, mask)) == pytest.approx(math.exp(0.5))


# --- trainers --------------------------------------------------------------------------------------

def _trainer(model_path, tokenizer, tmp_path, cls=MAGRPOTrainer, config=MAGRPOConfig, num_agents=2, **overrides):
    settings = dict(TEST_SETTINGS, num_train_epochs=2, max_new_tokens=12, agent_learning_rate=1e-3,
                    output_dir=str(tmp_path / "out"))
    settings.update(overrides)
    return cls(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(num_agents)],
               tokenizer=tokenizer, reward_func=length_ratio_reward if num_agents == 2 else _one_agent_reward,
               train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=config(**settings))


def _one_agent_reward(completions):
    return [math.exp(-abs(len(c) - 20) / 10) for c in completions]


def test_the_clipped_update_of_one_pass_over_one_step_buffers_is_magrpo_bit_for_bit(model_path, tokenizer, tmp_path):
    """The ratio to the sampling policy is exactly 1 on the first update of a buffer's samples, so
    the clip never acts and the clipped loss's gradient is REINFORCE's: the same weights, bit for
    bit (with eps=None and one pass the update is MAGRPO's own code path)."""
    plain = _trainer(model_path, tokenizer, tmp_path / "a")
    plain.train()
    for settings in ({"ppo_clip_eps": 0.2}, {"ppo_clip_eps": None, "num_update_epochs": 1}):
        clipped = _trainer(model_path, tokenizer, tmp_path / "b", **settings)
        clipped.train()
        assert_bit_exact(state_of(plain), state_of(clipped))


def test_the_sampling_policys_log_probs_cost_no_extra_forward(model_path, tokenizer, tmp_path, monkeypatch):
    """One optimizer step per buffer: the old log-probs are that step's own forward (0 extra passes);
    two steps per buffer: the other step's rows are read once before the first update."""
    import comlrl.trainers.reinforce.magrpo as magrpo

    calls = []
    original = magrpo.rows_log_probs
    monkeypatch.setattr(magrpo, "rows_log_probs", lambda *a, **k: calls.append(1) or original(*a, **k))
    _trainer(model_path, tokenizer, tmp_path / "a", ppo_clip_eps=0.2, num_update_epochs=3, num_train_epochs=1).train()
    assert calls == []
    trainer = _trainer(model_path, tokenizer, tmp_path / "b", ppo_clip_eps=0.2, num_update_epochs=2,
                       num_train_epochs=1, rollout_buffer_size=4, train_batch_size=2)
    trainer.train()
    assert len(calls) == 2  # per agent, the buffer's second step read before its first update
    assert trainer.state.global_step == 4  # 2 steps x 2 passes
    logged = rows(tmp_path / "b" / "out")[-1]
    assert 0 <= logged["agent_0/clip_fraction"] <= 1 and logged["global_step"] == 4


def test_interrupted_while_reading_the_sampling_policy_train_again_equals_uninterrupted(model_path, tokenizer, tmp_path,
                                                                                       monkeypatch):
    """An interruption while the buffer's later step's old log-probs are read (before agent 0's
    first update): train() again reads them again instead of taking the updated policy's."""
    import comlrl.trainers.reinforce.magrpo as magrpo

    settings = dict(ppo_clip_eps=0.2, num_update_epochs=2, num_train_epochs=1, rollout_buffer_size=4,
                    train_batch_size=2)
    full = _trainer(model_path, tokenizer, tmp_path / "full", **settings)
    full.train()
    flaky = _trainer(model_path, tokenizer, tmp_path / "flaky", **settings)
    original, calls = magrpo.rows_log_probs, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(magrpo, "rows_log_probs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        flaky.train()
    assert flaky.state.global_step == 0
    flaky.train()
    assert len(calls) == 3  # agent 0's read again, then agent 1's
    assert_bit_exact(state_of(full), state_of(flaky))


@pytest.mark.parametrize("cls,config,extra", [(MAGRPOTrainer, MAGRPOConfig, {"ppo_clip_eps": 0.2, "num_update_epochs": 2,
                                                                             "rollout_buffer_size": 2,
                                                                             "train_batch_size": 1}),
                                              (MAHAGRPOTrainer, MAHAGRPOConfig, {"num_update_epochs": 2})])
def test_resumed_equals_uninterrupted(model_path, tokenizer, tmp_path, cls, config, extra):
    full = _trainer(model_path, tokenizer, tmp_path / "full", cls, config, num_train_epochs=3, **extra)
    full.train(checkpoint_dir=tmp_path / "full-ck")
    first = _trainer(model_path, tokenizer, tmp_path / "part", cls, config, num_train_epochs=1, **extra)
    first.train(checkpoint_dir=tmp_path / "part-ck")
    resumed = _trainer(model_path, tokenizer, tmp_path / "part", cls, config, num_train_epochs=3, **extra)
    resumed.train(resume_from_checkpoint=tmp_path / "part-ck" / "checkpoint-1", checkpoint_dir=tmp_path / "part-ck")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full-ck") == rows(tmp_path / "part-ck")


def test_mahagrpo_updates_agents_one_after_another(model_path, tokenizer, tmp_path):
    trainer = _trainer(model_path, tokenizer, tmp_path, MAHAGRPOTrainer, MAHAGRPOConfig, num_agents=2,
                       num_train_epochs=1, agent_learning_rate=1e-2)
    orders = {tuple(trainer.update_order())}
    trainer.state.global_step = 5
    orders.add(tuple(trainer.update_order()))
    assert trainer.update_order() == trainer.update_order() and {(0, 1), (1, 0)} >= orders
    trainer.state.global_step = 0
    trainer.train()
    logged = rows(tmp_path / "out")
    # the agent updated second each step has its advantages weighted by the first one's clipped ratio
    weights = [r[k] for r in logged for k in r if k.endswith("advantage_weight_mean")]
    assert weights and all(0.8 - 1e-9 <= w <= 1.2 + 1e-9 for w in weights) and any(w != 1.0 for w in weights)
    assert sorted(logged[0][f"agent_{a}/update_position"] for a in range(2)) == [0.0, 1.0]
    assert trainer.state.global_step == 4  # one optimizer step per prompt, however many agents


def test_one_agent_mahagrpo_is_the_clipped_grpo_update(model_path, tokenizer, tmp_path):
    """With one agent there is no one before it: MAHAGRPO is MAGRPO's clipped update (GRPO)."""
    kwargs = dict(num_agents=1, num_train_epochs=1, num_update_epochs=2)
    sequential = _trainer(model_path, tokenizer, tmp_path / "a", MAHAGRPOTrainer, MAHAGRPOConfig, **kwargs)
    sequential.train()
    grpo = _trainer(model_path, tokenizer, tmp_path / "b", ppo_clip_eps=0.2, **kwargs)
    grpo.train()
    assert_bit_exact(state_of(sequential), state_of(grpo))


def test_settings_are_checked_when_built():
    with pytest.raises(ConfigError, match="ppo_clip_eps"):
        MAGRPOConfig(ppo_clip_eps=1.5)
    with pytest.raises(ConfigError, match="num_update_epochs"):
        MAGRPOConfig(num_update_epochs=0)
    with pytest.raises(ConfigError, match="joint_mode='aligned'"):
        MAHAGRPOConfig(joint_mode="cross")
    assert MAHAGRPOConfig().ppo_clip_eps == 0.2 and MAGRPOConfig().ppo_clip_eps is None
