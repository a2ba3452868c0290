"""completion_mask, selected_log_probs, sequence_log_probs and policy_gradient_loss against
slow, explicit references."""

from __future__ import annotations

import pytest
import torch

from comlrl.functional import completion_mask, policy_gradient_loss, selected_log_probs, sequence_log_probs
from comlrl.rollout import left_pad  # building padded inputs; not what these tests check


# --------------------------------------------------------------------------------------------
# completion_mask
# --------------------------------------------------------------------------------------------


def ref_completion_mask(ids: list[list[int]], eos: set[int]) -> list[list[bool]]:
    out = []
    for row in ids:
        mask = []
        seen = False
        for tok in row:
            mask.append(not seen)
            if tok in eos:
                seen = True
        out.append(mask)
    return out


def test_completion_mask_handwritten():
    ids = torch.tensor([
        [5, 6, 0, 7, 0],   # EOS at 2: scored up to and including it
        [0, 3, 3, 3, 3],   # EOS first
        [4, 4, 4, 4, 4],   # no EOS: fully scored
        [4, 4, 4, 4, 0],   # EOS last
        [1, 9, 0, 0, 0],   # padding with the EOS id after the EOS
    ])
    want = torch.tensor([
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
    ], dtype=torch.bool)
    got = completion_mask(ids, [0])
    assert got.dtype == torch.bool
    assert torch.equal(got, want)


@pytest.mark.parametrize("eos_ids", [[0], [3], [0, 3], [3, 0, 3], (7, 1, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_completion_mask_matches_loop(eos_ids, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (40, 17), generator=g)
    ids[0] = 11  # guarantee a row with no EOS at all (11 is never an EOS id here)
    got = completion_mask(ids, eos_ids)
    want = torch.tensor(ref_completion_mask(ids.tolist(), set(eos_ids)), dtype=torch.bool)
    assert torch.equal(got, want)
    assert got[0].all()
    # some rows must actually have been cut, or this test proves nothing
    assert not got.all()


def test_completion_mask_multiple_eos_ids_first_of_any():
    ids = torch.tensor([[5, 2, 9, 1, 5], [5, 5, 1, 2, 5], [5, 5, 5, 5, 5]])
    got = completion_mask(ids, iter([1, 2]))  # any iterable, not just a list
    want = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_completion_mask_int32_ids():
    ids = torch.tensor([[3, 0, 3], [3, 3, 3]], dtype=torch.int32)
    assert torch.equal(completion_mask(ids, [0]), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# selected_log_probs
# --------------------------------------------------------------------------------------------


def ref_selected(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_rows", [1, 2, 3, 5, 16, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_selected_log_probs_matches_log_softmax(chunk_rows, temperature):
    g = torch.Generator().manual_seed(0)
    rows, t, v = 7, 5, 33
    logits = torch.randn(rows, t, v, generator=g) * 3
    tokens = torch.randint(0, v, (rows, t), generator=g)
    got = selected_log_probs(logits, tokens, temperature, chunk_rows=chunk_rows)
    assert got.shape == (rows, t) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref_selected(logits, tokens, temperature), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selected_log_probs_gradient(temperature):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 4, 19, generator=g)
    tokens = torch.randint(0, 19, (5, 4), generator=g)
    weights = torch.randn(5, 4, generator=g)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad((selected_log_probs(a, tokens, temperature, chunk_rows=2) * weights).sum(), a)
    (gb,) = torch.autograd.grad((ref_selected(b, tokens, temperature) * weights).sum(), b)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_selected_log_probs_half_precision_input_returns_float32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 4, 50, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (3, 4), generator=g)
    got = selected_log_probs(logits, tokens, 0.8, chunk_rows=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref_selected(logits.float(), tokens, 0.8), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# policy_gradient_loss
# --------------------------------------------------------------------------------------------


def ref_pg_loss(log_probs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, loss_type: str,
                max_new_tokens=None) -> torch.Tensor:
    rows, t = log_probs.shape
    if loss_type == "grpo":
        total = log_probs.new_zeros(())
        for r in range(rows):
            row_sum = log_probs.new_zeros(())
            n = 0
            for j in range(t):
                if mask[r, j]:
                    row_sum = row_sum + (-adv[r] * log_probs[r, j])
                    n += 1
            total = total + row_sum / max(n, 1)
        return total / rows
    total = log_probs.new_zeros(())
    n = 0
    for r in range(rows):
        for j in range(t):
            if mask[r, j]:
                total = total + (-adv[r] * log_probs[r, j])
                n += 1
    if loss_type == "token_mean":
        return total / max(n, 1)
    if loss_type == "dr_grpo":
        return total / (rows * max_new_tokens)
    raise AssertionError(loss_type)


def _pg_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, t = 6, 9
    log_probs = -torch.rand(rows, t, generator=g) * 5
    adv = torch.randn(rows, generator=g)
    lengths = torch.tensor([9, 1, 4, 7, 2, 9])  # uneven lengths, one full row, one length-1 row
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return log_probs, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type", ["grpo", "token_mean", "dr_grpo"])
def test_policy_gradient_loss_value_and_gradient(loss_type, seed):
    log_probs, adv, mask = _pg_inputs(seed)
    max_new = 12
    a = log_probs.clone().requires_grad_(True)
    b = log_probs.clone().requires_grad_(True)
    got = policy_gradient_loss(a, adv, mask, loss_type=loss_type, max_new_tokens=max_new)
    want = ref_pg_loss(b, adv, mask, loss_type, max_new)
    assert got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (ga,) = torch.autograd.grad(got, a)
    (gb,) = torch.autograd.grad(want, b)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    # masked tokens get no gradient at all
    assert torch.all(ga[~mask] == 0)


def test_policy_gradient_loss_types_differ():
    """The three normalisations are really different on uneven lengths (guards against aliasing)."""
    log_probs, adv, mask = _pg_inputs(0)
    losses = [policy_gradient_loss(log_probs, adv, mask, lt, max_new_tokens=12).item()
              for lt in ("grpo", "token_mean", "dr_grpo")]
    assert len({round(x, 6) for x in losses}) == 3


def test_policy_gradient_loss_gradient_is_minus_advantage_weighted():
    """Closed form for grpo: d loss / d logp[r, j] = -A_r / (len_r * R) on scored tokens."""
    log_probs, adv, mask = _pg_inputs(3)
    lp = log_probs.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(policy_gradient_loss(lp, adv, mask, "grpo"), lp)
    lengths = mask.sum(dim=1, keepdim=True).float()
    want = torch.where(mask, -adv.unsqueeze(1) / (lengths * mask.shape[0]), torch.zeros(()))
    torch.testing.assert_close(grad, want)


def test_policy_gradient_loss_errors():
    log_probs, adv, mask = _pg_inputs(0)
    with pytest.raises(ValueError):
        policy_gradient_loss(log_probs, adv, mask, "dr_grpo")
    with pytest.raises(ValueError):
        policy_gradient_loss(log_probs, adv, mask, "sum")


# --------------------------------------------------------------------------------------------
# sequence_log_probs on tiny models
# --------------------------------------------------------------------------------------------

_MODELS: dict[str, tuple] = {}


def _tiny(kind: str):
    if kind not in _MODELS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from comlrl.testing import tiny_model_dir

        path = tiny_model_dir(kind)
        model = AutoModelForCausalLM.from_pretrained(path)
        model.eval()  # no dropout (gpt2 has some by default)
        tok = AutoTokenizer.from_pretrained(path)
        _MODELS[kind] = (model, tok)
    return _MODELS[kind]


def _ref_row_logp(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """One row, no padding, plain forward: log_softmax(logits / T) gathered at the completion."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0]
    start = len(prompt) - 1
    pred = logits[start:start + len(completion)]
    return torch.log_softmax(pred.float() / temperature, dim=-1).gather(
        -1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def _batch(tok):
    prompts = ["Describe a city in the clouds", "Hi", "The quick brown fox jumps over the lazy dog. A"]
    prompt_lists = [tok(p)["input_ids"] for p in prompts]
    assert len({len(p) for p in prompt_lists}) == 3  # really different lengths -> real left padding
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(1, 512, (3, 6), generator=g)
    completion[1, 3] = 0     # an EOS in the middle, followed by pad ids (also 0)
    completion[1, 4:] = 0
    return prompt_lists, completion


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_log_probs_batched_equals_unpadded_rows(kind, temperature):
    model, tok = _tiny(kind)
    prompt_lists, completion = _batch(tok)
    prompt_ids, prompt_mask = left_pad(prompt_lists, tok.pad_token_id)
    with torch.no_grad():
        got = sequence_log_probs(model, prompt_ids, prompt_mask, completion, temperature)
        assert got.shape == completion.shape and got.dtype == torch.float32
        for r, prompt in enumerate(prompt_lists):
            want = _ref_row_logp(model, prompt, completion[r].tolist(), temperature)
            torch.testing.assert_close(got[r], want, rtol=0, atol=1e-5)
    assert (got <= 0).all() and torch.isfinite(got).all()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2"])
def test_sequence_log_probs_gradient_equals_unpadded_rows(kind):
    model, tok = _tiny(kind)
    prompt_lists, completion = _batch(tok)
    prompt_ids, prompt_mask = left_pad(prompt_lists, tok.pad_token_id)
    params = [p for p in model.parameters() if p.requires_grad]
    temperature = 0.8

    batched = sequence_log_probs(model, prompt_ids, prompt_mask, completion, temperature).sum()
    grads = torch.autograd.grad(batched, params, allow_unused=True)

    ref_total = sum(_ref_row_logp(model, p, completion[r].tolist(), temperature).sum()
                    for r, p in enumerate(prompt_lists))
    ref_grads = torch.autograd.grad(ref_total, params, allow_unused=True)

    torch.testing.assert_close(batched, ref_total, rtol=0, atol=1e-4)
    nonzero = 0
    for p, ga, gb in zip(params, grads, ref_grads):
        if gb is None:
            assert ga is None or torch.all(ga == 0)
            continue
        assert ga is not None
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)
        nonzero += int(gb.abs().sum() > 0)
    assert nonzero > len(params) // 2


def test_sequence_log_probs_prompt_padding_is_invisible():
    """Adding extra left padding to the whole batch leaves the log-probs unchanged."""
    model, tok = _tiny("qwen2")
    prompt_lists, completion = _batch(tok)
    ids, mask = left_pad(prompt_lists, tok.pad_token_id)
    extra = 4
    ids2 = torch.cat([torch.full((3, extra), tok.pad_token_id), ids], dim=1)
    mask2 = torch.cat([torch.zeros(3, extra, dtype=torch.long), mask], dim=1)
    with torch.no_grad():
        a = sequence_log_probs(model, ids, mask, completion)
        b = sequence_log_probs(model, ids2, mask2, completion)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sequence_log_probs_depends_on_the_prompt():
    """Sanity: the reference comparison is sensitive (different prompt -> different log-probs)."""
    model, tok = _tiny("qwen2")
    prompt_lists, completion = _batch(tok)
    ids, mask = left_pad(prompt_lists, tok.pad_token_id)
    with torch.no_grad():
        a = sequence_log_probs(model, ids, mask, completion)
        shifted = _ref_row_logp(model, prompt_lists[0][1:], completion[0].tolist(), 1.0)
    assert (a[0] - shifted).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# linear_selected_log_probs: the fused head + log-softmax + gather, against autograd
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_selected_log_probs_equals_autograd_reference(monkeypatch, save, temperature, with_bias):
    from comlrl.functional import logprobs as losses

    if not save:  # force chunk-by-chunk recomputation in the backward pass (3 rows per chunk)
        monkeypatch.setattr(losses, "SAVE_LOGITS_BYTES", 3 * 4 * 50)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    tokens = torch.randint(0, 50, (10,), generator=g)
    upstream = torch.randn(10, generator=g, dtype=torch.float64)

    got = losses.linear_selected_log_probs(hidden, weight, bias, tokens, temperature)
    (got.double() * upstream).sum().backward()
    grads = [hidden.grad.clone(), weight.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for t in [hidden, weight] + ([bias] if with_bias else []):
        t.grad = None
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    want = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    expected = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sequence_log_probs_fused_head_equals_full_logits_path(monkeypatch):
    """The hidden-state path (fused head) == the model's own logits (all parameters' gradients)."""
    from comlrl.functional import logprobs as losses

    model, tok = _tiny("qwen2")
    prompt_lists, completion = _batch(tok)
    ids, mask = left_pad(prompt_lists, tok.pad_token_id)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(losses, "_plain_head", lambda model: None)
        model.zero_grad()
        logp = sequence_log_probs(model, ids, mask, completion, 0.8)
        logp.sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()
