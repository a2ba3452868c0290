"""sample_tokens, generate, rollout and derive_seed against slow references and transformers'
own logits warpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comlrl.functional import completion_mask
from comlrl.rollout import SamplingParams, derive_seed, left_pad, row_uniforms, sample_tokens
from comlrl.rollout.transformers_loop import generate, rollout


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def hf_warp(logits: torch.Tensor, temperature: float, top_p: float, top_k) -> torch.Tensor:
    """transformers' sampling filters, in generate()'s order: temperature, top-k, top-p."""
    scores = logits.float()
    dummy = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(dummy, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(dummy, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(dummy, scores)
    return scores


def uniforms_from(seed: int, n: int) -> torch.Tensor:
    """Deterministic uniforms in (0, 1]."""
    return 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# sample_tokens: (a) frequencies
# --------------------------------------------------------------------------------------------

FIXED_LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 0.7])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep].double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.8])
def test_sample_tokens_frequencies_match_softmax(temperature):
    n = 200_000
    u = uniforms_from(1234, n)
    tokens = sample_tokens(FIXED_LOGITS.expand(n, -1), u, temperature)
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    counts = torch.bincount(tokens, minlength=FIXED_LOGITS.numel())
    probs = torch.softmax(FIXED_LOGITS.double() / temperature, dim=-1)
    # 6 degrees of freedom: P(chi2 > 30) ~ 4e-5 for a correct sampler; a wrong temperature or an
    # off-by-one in the CDF gives values in the thousands.
    assert _chi_square(counts, probs, n) < 30.0
    # and every token is really drawn at roughly its probability
    torch.testing.assert_close(counts.double() / n, probs, rtol=0, atol=5e-3)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 3, 1.0), (0.8, None, 0.7), (1.3, 5, 0.85)])
def test_sample_tokens_filtered_frequencies_match_transformers(temperature, top_k, top_p):
    n = 200_000
    u = uniforms_from(99, n)
    tokens = sample_tokens(FIXED_LOGITS.expand(n, -1), u, temperature, top_p, top_k)
    counts = torch.bincount(tokens, minlength=FIXED_LOGITS.numel())
    probs = torch.softmax(hf_warp(FIXED_LOGITS.unsqueeze(0), temperature, top_p, top_k)[0].double(), dim=-1)
    assert (probs == 0).any()  # the filter really removed something
    assert torch.all(counts[probs == 0] == 0)
    assert _chi_square(counts, probs, n) < 30.0


def test_sample_tokens_inverse_cdf_grid():
    """A regular grid of u over (0, 1] lands on each token in proportion to its probability, in
    vocabulary order (inverse CDF): the same u always picks the same token."""
    m = 10_000
    u = torch.arange(1, m + 1, dtype=torch.float64) / m
    tokens = sample_tokens(FIXED_LOGITS.expand(m, -1), u)
    assert torch.all(tokens[1:] >= tokens[:-1])  # monotone in u
    probs = torch.softmax(FIXED_LOGITS.double(), dim=-1)
    counts = torch.bincount(tokens, minlength=FIXED_LOGITS.numel()).double()
    assert torch.all((counts / m - probs).abs() <= 1.0 / m + 1e-9)


def test_sample_tokens_rows_independent():
    """Each row uses only its own logits and its own uniform."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=g) * 2
    u = uniforms_from(4, 8)
    together = sample_tokens(logits, u, 0.9, 0.8, 10)
    alone = torch.cat([sample_tokens(logits[i:i + 1], u[i:i + 1], 0.9, 0.8, 10) for i in range(8)])
    assert torch.equal(together, alone)
    # same uniform, other rows' logits permuted -> row 0 unchanged
    shuffled = torch.cat([logits[:1], logits[1:].flip(0)])
    assert sample_tokens(shuffled, u, 0.9, 0.8, 10)[0] == together[0]


# --------------------------------------------------------------------------------------------
# sample_tokens: (b) the support under top-k / top-p equals transformers' warpers
# --------------------------------------------------------------------------------------------

_SWEEP = torch.cat([torch.tensor([2.0 ** -53, 1e-12]), torch.linspace(0.0, 1.0, 4001, dtype=torch.float64)[1:]])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("top_k", [None, 1, 5, 20, 1000])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6, 0.2])
def test_sample_tokens_support_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(17)
    v = 50
    for row in range(3):
        logits = torch.randn(1, v, generator=g) * (1.0 + row)
        warped = hf_warp(logits, temperature, top_p, top_k)[0]
        support = torch.isfinite(warped)
        probs = torch.softmax(warped.double(), dim=-1)

        # the sweep never picks a token the warpers removed
        picked = sample_tokens(logits.expand(_SWEEP.numel(), -1), _SWEEP, temperature, top_p, top_k)
        assert support[picked].all(), (row, sorted(set(picked.tolist()) - set(support.nonzero().flatten().tolist())))

        # every kept token is picked by the u at the middle of its CDF interval (vocabulary order)
        cdf = torch.cumsum(probs, dim=0)
        lower = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
        kept = support.nonzero().flatten()
        mid_u = ((lower + cdf) / 2 / cdf[-1])[kept]
        got = sample_tokens(logits.expand(kept.numel(), -1), mid_u, temperature, top_p, top_k)
        assert torch.equal(got, kept), (row, got.tolist(), kept.tolist())

        # the exact support size transformers keeps
        if top_k:
            assert support.sum() <= min(top_k, v)


def test_sample_tokens_top_k_zero_and_none_mean_no_limit():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2000, 30, generator=g)
    u = uniforms_from(6, 2000)
    base = sample_tokens(logits, u, 1.0, 1.0, None)
    assert torch.equal(sample_tokens(logits, u, 1.0, 1.0, 0), base)
    assert torch.equal(sample_tokens(logits, u, 1.0, 1.0, 30), base)
    assert torch.equal(sample_tokens(logits, u, 1.0, 1.0, 500), base)  # k > V is clamped
    assert not torch.equal(sample_tokens(logits, u, 1.0, 1.0, 2), base)


def test_sample_tokens_top_k_1_is_greedy():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(64, 100, generator=g)
    u = uniforms_from(9, 64)
    assert torch.equal(sample_tokens(logits, u, 0.7, 1.0, 1), logits.argmax(dim=-1))
    # a tiny top_p keeps only the most likely token as well
    assert torch.equal(sample_tokens(logits, u, 1.0, 1e-6, None), logits.argmax(dim=-1))


# --------------------------------------------------------------------------------------------
# sample_tokens: (c) extreme uniforms
# --------------------------------------------------------------------------------------------

_EXTREME_U = [1.0, 1.0 - 2.0 ** -53, 2.0 ** -53, 1e-300]


@pytest.mark.parametrize("u", _EXTREME_U)
def test_extreme_uniforms_never_pick_zero_probability_tokens(u):
    inf = float("inf")
    logits = torch.tensor([
        [-inf, -inf, 1.0, 2.0, -inf, 0.5, -inf, -inf],   # masked at both ends and in the middle
        [0.0, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0, -1000.0],  # underflow to 0
        [-1000.0, -1000.0, -1000.0, 0.0, -1000.0, -1000.0, -1000.0, -1000.0],
        [3.0, -inf, -inf, -inf, -inf, -inf, -inf, 1.0],
    ])
    rows = logits.shape[0]
    uu = torch.full((rows,), u, dtype=torch.float64)
    for temperature, top_p, top_k in [(1.0, 1.0, None), (0.5, 1.0, None), (1.0, 1.0, 2), (1.0, 0.5, None),
                                      (1.3, 0.9, 3)]:
        tokens = sample_tokens(logits, uu, temperature, top_p, top_k)
        warped = hf_warp(logits, temperature, top_p, top_k)
        probs = torch.softmax(warped.double(), dim=-1)
        picked = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        assert torch.all(picked > 0), (u, temperature, top_p, top_k, tokens.tolist())


def test_extreme_uniforms_pick_the_ends_of_the_support():
    inf = float("inf")
    logits = torch.tensor([[-inf, -inf, 1.0, 2.0, -inf, 0.5, -inf, -inf]])
    assert sample_tokens(logits, torch.tensor([1.0], dtype=torch.float64)).item() == 5
    assert sample_tokens(logits, torch.tensor([2.0 ** -53], dtype=torch.float64)).item() == 2
    # top_k=2 drops token 5 (logit 0.5): the largest u now lands on token 3
    assert sample_tokens(logits, torch.tensor([1.0], dtype=torch.float64), top_k=2).item() == 3


def test_extreme_uniforms_with_top_p_removing_the_vocabulary_ends():
    # top_p removes the low-probability tokens at both ends of the vocabulary
    logits = torch.tensor([[-4.0, 2.0, 2.5, 1.8, -4.0]])
    for u in _EXTREME_U:
        tok = sample_tokens(logits, torch.tensor([u], dtype=torch.float64), 1.0, 0.9).item()
        assert tok in (1, 2, 3), (u, tok)


# --------------------------------------------------------------------------------------------
# tiny models, biased towards EOS so that completions end
# --------------------------------------------------------------------------------------------

EOS_BIAS = 3.5
_MODELS: dict[str, tuple] = {}


def biased_model(kind: str = "qwen2"):
    """A tiny model whose output layer gets a +EOS_BIAS bias on token 0 (EOS): about 6% EOS per
    step, so within 16-32 tokens some completions end and others are cut by max_new_tokens."""
    if kind not in _MODELS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from comlrl.testing import tiny_model_dir

        path = tiny_model_dir(kind)
        model = AutoModelForCausalLM.from_pretrained(path)
        old = model.get_output_embeddings()
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            head.bias[0] = EOS_BIAS
        model.set_output_embeddings(head)
        model.eval()
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.eos_token_id == 0 and tok.pad_token_id == 0
        _MODELS[kind] = (model, tok)
    return _MODELS[kind]


PROMPTS = ["Describe a city in the clouds.", "Hi", "Invent a new holiday and explain it: on the day of"]


@torch.no_grad()
def slow_generate(model, prompt_ids, prompt_mask, uniforms, params, eos_token_ids, pad_token_id):
    """No KV cache: a full forward over the whole left-padded sequence for every new token."""
    seq, mask = prompt_ids, prompt_mask
    rows = seq.shape[0]
    finished = torch.zeros(rows, dtype=torch.bool)
    steps = []
    for t in range(params.max_new_tokens):
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=seq, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
        token = sample_tokens(logits, uniforms[:, t], params.temperature, params.top_p, params.top_k)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        steps.append(token)
        finished = finished | torch.tensor([x in eos_token_ids for x in token.tolist()])
        if finished.all():
            break
        seq = torch.cat([seq, token.unsqueeze(1)], dim=1)
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], dim=1)
    return torch.stack(steps, dim=1)


def _generate_inputs(tok, rows_per_prompt=2, max_new_tokens=16, seed0=100):
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    rows = [ids for ids in enc for _ in range(rows_per_prompt)]
    prompt_ids, prompt_mask = left_pad(rows, tok.pad_token_id)
    seeds = [seed0 + i for i in range(len(rows))]
    return prompt_ids, prompt_mask, row_uniforms(seeds, max_new_tokens)


@pytest.mark.parametrize("kind,params,eos,pad", [
    ("qwen2", SamplingParams(max_new_tokens=16), [0], 0),
    ("qwen2", SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, top_k=300), [0, 7], 5),
    ("llama", SamplingParams(max_new_tokens=16, temperature=1.2), [0], 0),
    ("gpt2", SamplingParams(max_new_tokens=16, top_k=400), [0], 3),
])
def test_generate_with_cache_equals_full_recompute(kind, params, eos, pad):
    model, tok = biased_model(kind)
    prompt_ids, prompt_mask, uniforms = _generate_inputs(tok, max_new_tokens=params.max_new_tokens)
    got = generate(model, prompt_ids, prompt_mask, uniforms, params, eos, pad)
    want = slow_generate(model, prompt_ids, prompt_mask, uniforms, params, eos, pad)
    assert got.dtype == torch.int64
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want), (got, want)
    # after a row's first EOS, only pad_token_id
    mask = completion_mask(got, eos)
    assert torch.all(got[~mask] == pad)
    # the completions are not degenerate (otherwise the comparison proves little)
    assert len({tuple(r) for r in got.tolist()}) >= got.shape[0] // 2
    assert mask.sum(dim=1).max() >= 6


def test_generate_stops_when_every_row_has_ended():
    model, tok = biased_model("qwen2")
    prompt_ids, prompt_mask, uniforms = _generate_inputs(tok, rows_per_prompt=1, max_new_tokens=200, seed0=7)
    params = SamplingParams(max_new_tokens=200)
    out = generate(model, prompt_ids, prompt_mask, uniforms, params, [0], 0)
    assert out.shape[1] < 200
    is_eos = out == 0
    assert is_eos.any(dim=1).all()               # every row ended
    assert is_eos[:, -1].all()                    # the last step holds an EOS or EOS-id padding
    first_eos = is_eos.int().argmax(dim=1)
    assert first_eos.max().item() == out.shape[1] - 1  # the loop stopped right when the last row ended


def test_generate_pads_rows_cut_by_nothing_and_respects_max_new_tokens():
    model, tok = biased_model("qwen2")
    prompt_ids, prompt_mask, uniforms = _generate_inputs(tok, max_new_tokens=5, seed0=1)
    out = generate(model, prompt_ids, prompt_mask, uniforms, SamplingParams(max_new_tokens=5), [0], 0)
    assert out.shape == (prompt_ids.shape[0], 5)


# --------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------

K = 4
ROLLOUT_PARAMS = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95)


def _seeds(g_count=len(PROMPTS), k=K, epoch=0):
    return [[derive_seed("test", "agent0", epoch, g, j) for j in range(k)] for g in range(g_count)]


def _trim(ids_row: torch.Tensor, mask_row: torch.Tensor) -> list[int]:
    return ids_row[: int(mask_row.sum())].tolist()


def _trim_prompt(ids_row: torch.Tensor, mask_row: torch.Tensor) -> list[int]:
    return ids_row[mask_row.bool()].tolist()


def test_rollout_batched_equals_one_prompt_at_a_time():
    model, tok = biased_model("qwen2")
    seeds = _seeds()
    batched = rollout(model, tok, PROMPTS, seeds, ROLLOUT_PARAMS, [0])
    r = len(PROMPTS) * K
    assert batched.completion_ids.shape[0] == r and len(batched.texts) == r
    assert batched.group_ids.tolist() == [g for g in range(len(PROMPTS)) for _ in range(K)]
    # the data must contain both ended and cut completions, and prompts of different lengths
    lengths = batched.lengths
    ended = torch.tensor([0 in _trim(batched.completion_ids[i], batched.completion_mask[i]) for i in range(r)])
    assert ended.any() and (~ended).any()
    assert len(set(batched.prompt_mask.sum(dim=1).tolist())) == len(PROMPTS)

    for g, prompt in enumerate(PROMPTS):
        single = rollout(model, tok, [prompt], [seeds[g]], ROLLOUT_PARAMS, [0])
        assert single.group_ids.tolist() == [0] * K
        for k in range(K):
            row = g * K + k
            assert batched.texts[row] == single.texts[k]
            assert _trim(batched.completion_ids[row], batched.completion_mask[row]) == \
                _trim(single.completion_ids[k], single.completion_mask[k])
            assert _trim_prompt(batched.prompt_ids[row], batched.prompt_mask[row]) == \
                _trim_prompt(single.prompt_ids[k], single.prompt_mask[k]) == tok(prompt)["input_ids"]
            assert int(lengths[row]) == int(single.lengths[k])


def test_rollout_row_depends_only_on_its_seed():
    """One row at a time (K = 1), and with the order of the seeds inside a group reversed."""
    model, tok = biased_model("qwen2")
    seeds = _seeds(g_count=2)
    batched = rollout(model, tok, PROMPTS[:2], seeds, ROLLOUT_PARAMS, [0])
    reversed_ = rollout(model, tok, PROMPTS[:2], [list(reversed(s)) for s in seeds], ROLLOUT_PARAMS, [0])
    for g in range(2):
        for k in range(K):
            row = g * K + k
            one = rollout(model, tok, [PROMPTS[g]], [[seeds[g][k]]], ROLLOUT_PARAMS, [0])
            assert one.texts[0] == batched.texts[row]
            assert _trim(one.completion_ids[0], one.completion_mask[0]) == \
                _trim(batched.completion_ids[row], batched.completion_mask[row])
            assert reversed_.texts[g * K + (K - 1 - k)] == batched.texts[row]


def test_rollout_is_deterministic_and_seeds_matter():
    model, tok = biased_model("qwen2")
    seeds = _seeds()
    a = rollout(model, tok, PROMPTS, seeds, ROLLOUT_PARAMS, [0])
    b = rollout(model, tok, PROMPTS, seeds, ROLLOUT_PARAMS, [0])
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids, b.completion_ids)
    # within a group, different seeds -> different completions
    for g in range(len(PROMPTS)):
        group = [tuple(_trim(a.completion_ids[g * K + k], a.completion_mask[g * K + k])) for k in range(K)]
        assert len(set(group)) == K
    # another epoch -> other seeds -> other completions
    c = rollout(model, tok, PROMPTS, _seeds(epoch=1), ROLLOUT_PARAMS, [0])
    same = sum(x == y for x, y in zip(a.texts, c.texts))
    assert same <= 1


def test_rollout_padding_and_mask_stop_at_eos():
    model, tok = biased_model("qwen2")
    ro = rollout(model, tok, PROMPTS, _seeds(), ROLLOUT_PARAMS, [0])
    ids, mask = ro.completion_ids, ro.completion_mask
    assert mask.dtype == torch.bool and ids.shape == mask.shape
    assert ids.shape[1] <= ROLLOUT_PARAMS.max_new_tokens
    for i in range(ids.shape[0]):
        row = ids[i].tolist()
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any()   # a prefix
        if 0 in row:
            first = row.index(0)
            assert n == first + 1                              # up to and including the first EOS
            assert all(t == tok.pad_token_id for t in row[first + 1:])
        else:
            assert n == len(row) == ROLLOUT_PARAMS.max_new_tokens  # cut, fully scored
        # texts: the scored tokens without the closing EOS
        body = row[:n]
        if body and body[-1] == 0:
            body = body[:-1]
        assert ro.texts[i] == tok.decode(body, skip_special_tokens=True)
        assert "<|endoftext|>" not in ro.texts[i]
    assert torch.equal(ro.lengths, mask.sum(dim=1))
    # prompts are left-padded with the pad id
    assert torch.all(ro.prompt_ids[ro.prompt_mask == 0] == tok.pad_token_id)
    assert torch.all(ro.prompt_mask[:, -1] == 1)


def test_rollout_matches_generate_on_the_same_uniforms():
    model, tok = biased_model("qwen2")
    seeds = _seeds()
    ro = rollout(model, tok, PROMPTS, seeds, ROLLOUT_PARAMS, [0])
    flat = [s for grp in seeds for s in grp]
    uniforms = row_uniforms(flat, ROLLOUT_PARAMS.max_new_tokens)
    want = slow_generate(model, ro.prompt_ids, ro.prompt_mask, uniforms, ROLLOUT_PARAMS, [0], tok.pad_token_id)
    assert torch.equal(ro.completion_ids, want)


def test_rollout_restores_training_mode_and_outputs_are_usable_for_autograd():
    model, tok = biased_model("qwen2")
    model.train()
    try:
        ro = rollout(model, tok, PROMPTS[:1], [[1, 2]], SamplingParams(max_new_tokens=6), [0])
        assert model.training
    finally:
        model.eval()
    assert not ro.completion_ids.is_inference()
    from comlrl.functional import sequence_log_probs

    logp = sequence_log_probs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# derive_seed / row_uniforms
# --------------------------------------------------------------------------------------------


def test_derive_seed_deterministic_and_distinct():
    parts = ("run", 3, "agent1", 0, 17, 2)
    a, b = derive_seed(*parts), derive_seed(*parts)
    assert a == b
    assert isinstance(a, int) and 0 <= a < 2 ** 63
    variants = [
        ("run", 3, "agent1", 0, 17, 3),
        ("run", 3, "agent1", 0, 18, 2),
        ("run", 3, "agent0", 0, 17, 2),
        ("run", 4, "agent1", 0, 17, 2),
        ("run", 3, "agent1", 1, 17, 2),
        ("run", 3, "agent1", 0, 17),
        (3, "run", "agent1", 0, 17, 2),
        ("run", "3", "agent1", 0, 17, 2),  # str vs int
    ]
    seeds = {derive_seed(*v) for v in variants}
    assert a not in seeds and len(seeds) == len(variants)
    many = {derive_seed(0, e, g, k) for e in range(3) for g in range(20) for k in range(8)}
    assert len(many) == 3 * 20 * 8


def test_derive_seed_stable_across_processes():
    """Not Python's randomised hash(): the same parts give the same seed in another process."""
    code = ("from comlrl.rollout import derive_seed; "
            "print(derive_seed('run', 3, 'agent1', 0, 17, 2), derive_seed(1, 2.5, None, ('a', 'b')))")
    # this process has a random hash seed (or whatever the runner chose); the child another one
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    here = f"{derive_seed('run', 3, 'agent1', 0, 17, 2)} {derive_seed(1, 2.5, None, ('a', 'b'))}"
    assert res.stdout.strip() == here


def test_row_uniforms_per_row_generators():
    u = row_uniforms([5, 6, 5], 50)
    assert u.shape == (3, 50) and u.dtype == torch.float64
    assert torch.all(u > 0) and torch.all(u <= 1)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    # a row does not depend on its neighbours or on the global RNG
    torch.manual_seed(0)
    alone = row_uniforms([6], 50)
    assert torch.equal(alone[0], u[1])
    # prefixes agree: a shorter draw is the start of a longer one
    assert torch.equal(row_uniforms([6], 10)[0], u[1, :10])
    assert row_uniforms([], 4).shape == (0, 4)


def test_a_prompt_filling_the_context_is_refused_not_run_past_it():
    """A prompt longer than the model's context ran one forward for 90 s (issue 29): refused with
    what to change; a prompt that leaves room has its completion cut to fit."""
    from types import SimpleNamespace

    from comlrl import DataError
    from comlrl.rollout.sampling import SamplingParams
    from comlrl.rollout.transformers_loop import fit_context

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=16))
    params = SamplingParams(max_new_tokens=8)
    assert fit_context([model], [12], params).max_new_tokens == 4
    assert fit_context([model], [15], params).max_new_tokens == 1
    for width in (16, 4000):
        with pytest.raises(DataError, match=f"a prompt of {width} tokens does not fit the model's context of 16"):
            fit_context([model], [width], params)
