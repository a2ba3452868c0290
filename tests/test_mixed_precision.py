"""mixed_precision="bf16": sampling and the update on bfloat16 compute copies of float32 masters,
autocast where there is no copy (LoRA agents), tested on CPU."""

import json
import math

import pytest
import torch

from comlrl import MAGRPOConfig
from comlrl.exceptions import ConfigError
from comlrl.functional import linear_selected_log_probs, sequence_log_probs
from comlrl.rollout import left_pad


def test_only_bf16_is_accepted():
    assert MAGRPOConfig(mixed_precision="bf16").mixed_precision == "bf16"
    with pytest.raises(ConfigError, match="mixed_precision"):
        MAGRPOConfig(mixed_precision="fp8")
    with pytest.raises(ConfigError, match="did you mean 'mixed_precision'"):
        MAGRPOConfig(bf16=True)


def test_fused_head_backward_under_autocast_matches_autograd():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_selected_log_probs(hidden, weight, None, tokens)
    got.sum().backward()
    fused = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    want = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    want.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for a, b in zip(fused, (hidden.grad, weight.grad)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_a_bf16_head_gradient_over_many_chunks_is_summed_in_float32(monkeypatch):
    """The fused head's backward in bf16 (the compute copy's head) over 256 chunks: its weight
    gradient is within 0.5% of float64's, as over one chunk (measured 0.27% both; summed in bf16
    over the chunks, as before, 1.4%)."""
    from comlrl.functional import logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 32, generator=g).to(torch.bfloat16)
    weight = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2048,), generator=g)
    exact = weight.double().requires_grad_(True)
    torch.log_softmax(hidden.double() @ exact.t(), -1).gather(-1, tokens[:, None]).sum().backward()
    monkeypatch.setattr(logprobs, "SAVE_LOGITS_BYTES", 8 * 64 * 4)  # 8 rows a chunk
    w = weight.clone().requires_grad_(True)
    linear_selected_log_probs(hidden, w, None, tokens).sum().backward()
    assert w.grad.dtype == torch.bfloat16
    assert float((w.grad.double() - exact.grad).norm() / exact.grad.norm()) < 0.005


def test_log_probs_under_autocast_stay_close(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], 0)
    completion = torch.tensor([[11, 12, 13], [14, 15, 0]])
    full = sequence_log_probs(model, ids, mask, completion)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = sequence_log_probs(model, ids, mask, completion)
    assert half.dtype == torch.float32
    assert float((half - full).detach().abs().max()) < 0.05 * (1 + float(full.detach().abs().max()))


def test_training_in_bf16_runs_learns_a_step_and_is_reproducible(make_trainer, tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(num_train_epochs=1, mixed_precision="bf16", output_dir=str(tmp_path / name))
        before = [p.detach().clone() for p in trainer.agents[0].parameters()]
        trainer.train()
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        assert all(math.isfinite(r["agent_0/loss"]) and math.isfinite(r["agent_0/grad_norm"]) for r in rows)
        assert any(not torch.equal(p, q) for p, q in zip(trainer.agents[0].parameters(), before))
        assert all(p.dtype == torch.float32 for p in trainer.agents[0].parameters())  # weights keep their dtype
        runs.append([p.detach().clone() for p in trainer.agents[0].parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_fused_head_recompute_under_autocast_equals_saved_logits(monkeypatch):
    """The chunked recompute in backward runs under the forward's autocast, so its softmax matches
    the forward's row sums: the same gradients as when the logits are kept."""
    from comlrl.functional import logprobs as losses

    g = torch.Generator().manual_seed(1)
    hidden0 = torch.randn(9, 16, generator=g)
    weight0 = torch.randn(300, 16, generator=g)
    tokens = torch.randint(0, 300, (9,), generator=g)
    grads = []
    for limit in (losses.SAVE_LOGITS_BYTES, 2 * 4 * 300):  # keep everything / recompute 2 rows at a time
        monkeypatch.setattr(losses, "SAVE_LOGITS_BYTES", limit)
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = losses.linear_selected_log_probs(hidden, weight, None, tokens)
        out.sum().backward()
        grads.append((hidden.grad, weight.grad))
        # softmax rows sum to one: the gradient summed over the vocabulary is ~0 for every hidden dim
        assert float(weight.grad.sum(dim=0).abs().max()) < 0.05
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------------
# bf16 compute copies, fp32 masters (issue 32)
# ------------------------------------------------------------------------------------------------
def _copies(trainer):
    return trainer.backend.copies


def test_sampling_runs_on_bf16_copies_refreshed_after_each_optimizer_step(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1, mixed_precision="bf16", output_dir=str(tmp_path / "out"))
    copies = _copies(trainer)
    assert all(c is not None for c in copies)
    for agent, c in zip(trainer.agents, copies):
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in c.module.parameters())
        assert all(p.dtype == torch.float32 for p in agent.parameters())  # the masters
        assert not any(c.module is agent or q is p for q, p in zip(c.module.parameters(), agent.parameters()))
    with torch.no_grad():  # weights edited after the trainer was built (as load_state_dict would)
        for p in trainer.agents[0].parameters():
            p.add_(0.01)
    sampled = []
    original = trainer.backend.sampling_models

    def spy():
        models = original()
        # what sampling sees: the copies, equal to the masters cast now (none stale)
        for agent, model in zip(trainer.agents, models):
            assert all(torch.equal(q, p.detach().to(torch.bfloat16))
                       for q, p in zip(model.parameters(), agent.parameters()))
        sampled.append([c.refreshes for c in copies])
        return models

    trainer.backend.sampling_models = spy
    trainer.train()
    steps = trainer.state.global_step
    assert steps == 4 and len(sampled) == 4
    # refreshed when train() starts (weights may have been changed since the trainer was built),
    # then once per optimizer step, before the rollout that follows it
    assert sampled == [[i, i] for i in range(1, 5)]
    # the lean decoder ran on the copies (its one-time check against transformers' bf16 forward held)
    from comlrl.rollout import lean

    assert all(lean._VERIFIED.get(c.module) is True for c in copies)


def _small_model(tied: bool, frozen_norms: bool = False):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if frozen_norms:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.requires_grad_(False)
    return model


def test_tied_weights_stay_tied_in_the_compute_copy(tokenizer, tmp_path):
    from comlrl.rollout.compute import ComputeCopy

    model = _small_model(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    copy = ComputeCopy(model, torch.bfloat16)
    assert copy.module.lm_head.weight is copy.module.model.embed_tokens.weight
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    copy.refresh()
    assert torch.equal(copy.module.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def _as_trained_copy(model):
    """What ComputeCopy.trained() computes, built by hand: parameters in bf16 but the embedding
    (float32, its output cast to bf16), buffers (rotary frequencies) as they are."""
    import copy as copying

    reference = copying.deepcopy(model)
    for name, p in reference.named_parameters():
        if "embed_tokens" not in name:
            p.data = p.data.to(torch.bfloat16)
    reference.model.embed_tokens.register_forward_hook(lambda module, inputs, out: out.to(torch.bfloat16))
    return reference


def _loss(model, ids):
    return model(input_ids=ids).logits.float().logsumexp(-1).sum()


def test_backward_through_the_compute_copy_sums_its_gradients_into_the_fp32_masters():
    """ComputeCopy.trained(): each backward's gradients are those of the model in bf16 (its
    embedding read in float32, as under autocast), added to the master's float32 .grad: bit for
    bit their float32 sum over two backwards; frozen master parameters get none; the copy holds
    no gradient and requires none after the block, and its embedding is its own again."""
    from comlrl.rollout.compute import ComputeCopy

    model = _small_model(tied=False, frozen_norms=True)
    ids = [torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference, expected = _as_trained_copy(model), {}
    for x in ids:
        reference.zero_grad(set_to_none=True)
        _loss(reference, x).backward()
        for name, p in reference.named_parameters():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad.float()
    compute = ComputeCopy(model, torch.bfloat16)
    embedding = compute.module.model.embed_tokens.weight
    with compute.trained() as module:
        assert module is compute.module
        for x in ids:
            _loss(module, x).backward()
            assert all(p.grad is None for p in module.parameters() if p.dtype == torch.bfloat16)
    assert compute.module.model.embed_tokens.weight is embedding and embedding.dtype == torch.bfloat16
    assert all(not p.requires_grad and p.grad is None for p in compute.module.parameters())
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert {n for n, g in grads.items() if g is not None} == set(expected) == \
        {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(grads[n].dtype == torch.float32 and torch.equal(grads[n], expected[n]) for n in expected)


def test_a_tied_head_and_embedding_get_one_gradient_of_both_uses():
    from comlrl.rollout.compute import ComputeCopy

    model = _small_model(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    reference = _as_trained_copy(model)
    reference.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().to(torch.bfloat16))  # untied
    _loss(reference, x).backward()
    compute = ComputeCopy(model, torch.bfloat16)
    with compute.trained() as module:
        _loss(module, x).backward()
    assert [n for n, p in model.named_parameters() if p.grad is not None].count("model.embed_tokens.weight") == 1
    both = reference.model.embed_tokens.weight.grad + reference.lm_head.weight.grad.float()
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, both, rtol=1e-5, atol=1e-6)


def test_a_token_repeated_in_a_micro_batch_keeps_its_embedding_gradient():
    """One token 2048 times: its embedding row's gradient through the copy is within 5% of the
    float32 model's (measured 0.4%); added up in bfloat16, as a bf16 embedding's backward does on
    the CPU, it was 76% off."""
    import copy as copying

    from comlrl.rollout.compute import ComputeCopy

    model = _small_model(tied=False)
    x = torch.full((1, 2048), 5)
    full = copying.deepcopy(model)
    _loss(full, x).backward()
    compute = ComputeCopy(model, torch.bfloat16)
    with compute.trained() as module:
        _loss(module, x).backward()
    want, got = full.model.embed_tokens.weight.grad[5], model.model.embed_tokens.weight.grad[5]
    assert float((got - want).norm() / want.norm()) < 0.05


def test_the_update_runs_on_the_current_bf16_copy_without_autocast(make_trainer, model_path, tokenizer, tmp_path,
                                                                   monkeypatch):
    """With mixed_precision="bf16" every policy forward of the update (the loss's, the old log-probs
    of a buffer's later steps, MAHAGRPO's ratio after an agent's update; two passes of the clipped
    update per buffer) runs on the agent's compute copy, current with its master (refreshed after
    each optimizer step), outside autocast, and the masters move; in float32 the masters run."""
    from transformers import AutoModelForCausalLM

    from comlrl.engine import step as step_module
    from comlrl.trainers.reinforce import MAHAGRPOConfig, MAHAGRPOTrainer
    from comlrl.trainers.reinforce import magrpo as magrpo_module
    from comlrl.trainers.reinforce import mahagrpo as mahagrpo_module
    from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

    seen, live = [], {}

    def record(name):
        original = getattr(step_module, name)

        def run(model, *args, **kwargs):
            with kwargs["autocast"]():
                on = torch.is_autocast_enabled("cpu")
            trainer = live["trainer"]
            copies = [c.module if c is not None else None for c in trainer.backend.copies]
            agent = next((a for a, c in enumerate(copies) if c is model), None)
            current = agent is not None and all(  # (the embedding, read from the master meanwhile)
                torch.equal(q.detach().to(torch.bfloat16), p.detach().to(torch.bfloat16))
                for q, p in zip(model.parameters(), trainer.agents[agent].parameters()))
            seen.append((name, agent, current, on, any(model is a for a in trainer.agents)))
            return original(model, *args, **kwargs)
        return run

    for name in ("policy_backward", "rows_log_probs"):
        monkeypatch.setattr(magrpo_module, name, record(name))
    monkeypatch.setattr(mahagrpo_module, "rows_log_probs", record("rows_log_probs"))
    live["trainer"] = make_trainer(num_train_epochs=1, mixed_precision="bf16", rollout_buffer_size=2,
                                   train_batch_size=1, ppo_clip_eps=0.2, num_update_epochs=2,
                                   output_dir=str(tmp_path / "bf16"))
    before = [[p.detach().clone() for p in agent.parameters()] for agent in live["trainer"].agents]
    live["trainer"].train()
    names = [name for name, *_ in seen]
    # 2 buffers of 2 one-prompt steps, 2 passes: 8 optimizer steps of 2 agents; the old log-probs of
    # each buffer's second step, read before its first update, per agent
    assert live["trainer"].state.global_step == 8
    assert names.count("policy_backward") == 16 and names.count("rows_log_probs") == 4
    assert all(agent is not None and current and not on for _, agent, current, on, _ in seen)
    for agent, initial in zip(live["trainer"].agents, before):  # the gradients reached the masters
        assert all(p.dtype == torch.float32 for p in agent.parameters())
        assert sum(not torch.equal(p, q) for p, q in zip(agent.parameters(), initial)) > len(initial) // 2
    seen.clear()
    live["trainer"] = MAHAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
        tokenizer=tokenizer, reward_func=length_ratio_reward,
        train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=MAHAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": 1, "max_new_tokens": 12,
                               "mixed_precision": "bf16", "output_dir": str(tmp_path / "mahagrpo")}))
    live["trainer"].train()
    names = [name for name, *_ in seen]
    # one update of each agent per prompt; the first agent's ratio read after its update
    assert names.count("policy_backward") == 8 and names.count("rows_log_probs") == 4
    assert all(agent is not None and current and not on for _, agent, current, on, _ in seen)
    seen.clear()
    live["trainer"] = make_trainer(num_train_epochs=1, output_dir=str(tmp_path / "fp32"))
    live["trainer"].train()
    assert seen and all(master and agent is None for _, agent, _, _, master in seen)


def test_the_frozen_reference_is_kept_in_bf16(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1, mixed_precision="bf16", reference_kl_enabled=True,
                           reference_kl_coef=0.05, output_dir=str(tmp_path / "out"))
    for reference, agent in zip(trainer.reference_models, trainer.agents):
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in reference.parameters())
        assert all(torch.equal(r, p.detach().to(torch.bfloat16))
                   for r, p in zip(reference.parameters(), agent.parameters()))
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    kls = [r["agent_0/reference_kl"] for r in rows]
    assert all(math.isfinite(k) for k in kls) and any(k != 0 for k in kls)


def _movement(trainer) -> tuple[float, float]:
    """Train; returns the share of the agents' weight elements that changed and the L1 norm of the change."""
    before = [[p.detach().float().clone() for p in a.parameters()] for a in trainer.agents]
    trainer.train()
    moved = total = 0
    distance = 0.0
    for agent, old in zip(trainer.agents, before):
        for p, q in zip(agent.parameters(), old):
            change = p.detach().float() - q
            moved += int((change != 0).sum())
            distance += float(change.abs().sum())
            total += q.numel()
    return moved / total, distance


def test_pure_bf16_adamw_at_5e6_stalls_where_fp32_masters_move(model_path, tokenizer, tmp_path):
    """1.4.3's bf16 (models loaded in bfloat16, AdamW on bf16 weights): an update of ~lr = 5e-6 per
    element is far below bf16's resolution at these weights' size (~|w| / 256) and rounds away.
    mixed_precision="bf16" keeps float32 masters, which take it. Measured (8 optimizer steps, no
    clipping): pure bf16 moves 7.8% of the elements (those near zero, where bf16 is finer than the
    update) and 0.082x the L1 distance ours moves; ours moves every element."""
    from transformers import AutoModelForCausalLM

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

    def trainer(dtype, mixed, name):
        return MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype) for _ in range(2)],
            tokenizer=tokenizer, reward_func=length_ratio_reward,
            train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
            args=MAGRPOConfig(**{**TEST_SETTINGS, "max_grad_norm": None}, num_train_epochs=2, max_new_tokens=12,
                              agent_learning_rate=5e-6, mixed_precision=mixed, output_dir=str(tmp_path / name)))

    pure, pure_distance = _movement(trainer(torch.bfloat16, None, "pure"))
    ours, our_distance = _movement(trainer(torch.float32, "bf16", "ours"))
    print(f"\nat lr 5e-6, share of weight elements moved: pure bf16 {pure:.4f}, fp32 masters {ours:.4f}; L1 "
          f"distance moved {pure_distance:.4g} vs {our_distance:.4g} ({pure_distance / our_distance:.3f}x)")
    assert pure < 0.2 and ours > 0.9
    assert pure_distance < 0.2 * our_distance


def test_bf16_checkpoints_keep_fp32_masters_and_adamw_state(make_trainer, tmp_path):
    from safetensors import safe_open

    trainer = make_trainer(num_train_epochs=1, mixed_precision="bf16", output_dir=str(tmp_path / "out"))
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    for i, agent in enumerate(trainer.agents):
        folder = tmp_path / "ckpt" / "checkpoint-1" / f"agent-{i}"
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        assert saved and all(t.dtype == torch.float32 for t in saved.values())
        named = dict(agent.named_parameters())
        assert all(torch.equal(saved[k], named[k].detach()) for k in saved if k in named)
        with safe_open(str(folder / "optimizer.safetensors"), "pt") as f:
            moments = [f.get_tensor(k) for k in f.keys() if "exp_avg" in k]
        assert moments and all(t.dtype == torch.float32 for t in moments)


def test_bf16_resume_equals_uninterrupted_bit_exact(make_trainer, tmp_path):
    from helpers import assert_bit_exact, rows, state_of

    full = make_trainer(num_train_epochs=4, mixed_precision="bf16")
    full.train(checkpoint_dir=tmp_path / "full")
    part = make_trainer(num_train_epochs=2, mixed_precision="bf16")
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=4, mixed_precision="bf16")
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"), checkpoint_dir=tmp_path / "part")
    # the resumed run's copies were refreshed from the loaded masters before its first rollout
    assert all(c.refreshes >= 1 for c in resumed.backend.copies)
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")


def test_lora_agents_in_bf16_sample_under_autocast_without_copies(model_path, tokenizer, tmp_path):
    """LoRA agents share one base: no copy of it per agent (they sample under autocast as before)."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

    trainer = MAGRPOTrainer(agent_model=str(model_path), num_agents=2, tokenizer=tokenizer,
                            reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                            peft_config=LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                   task_type="CAUSAL_LM"),
                            args=MAGRPOConfig(**TEST_SETTINGS, num_train_epochs=1, max_new_tokens=6,
                                              mixed_precision="bf16", output_dir=str(tmp_path / "out")))
    assert trainer.backend.copies == [None, None]
    trainer.train()
    assert all(p.dtype == torch.float32 for a in trainer.agents for p in a.parameters())
