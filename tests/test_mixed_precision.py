"""mixed_precision="bf16": rollout and loss forwards under torch.autocast (tested on CPU)."""

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
