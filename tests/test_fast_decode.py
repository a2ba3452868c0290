"""The lean decode step (comlrl.fast_decode) against transformers' own forward."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from comlrl.rollout import lean as fast_decode
from comlrl.rollout.transformers_loop import _cache_kwarg, _output_cache, generate
from comlrl.rollout import SamplingParams, left_pad, row_uniforms
from comlrl.testing import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15], [16], [17, 18, 19, 20, 21]]


def small_model(kind: str, heads: int, kv_heads: int, dtype=torch.float32, **extra):
    torch.manual_seed(0)
    cls, config_cls = (Qwen2ForCausalLM, Qwen2Config) if kind == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    config = config_cls(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                        tie_word_embeddings=False, **extra)
    return cls(config).to(dtype).eval()


MODELS = {
    "qwen2-gqa": lambda: small_model("qwen2", 4, 2),
    "qwen2-mha": lambda: small_model("qwen2", 4, 4),
    "qwen2-mqa": lambda: small_model("qwen2", 4, 1),
    "llama-bias": lambda: small_model("llama", 4, 2, attention_bias=True, mlp_bias=True),
    "llama-rope-scaling": lambda: small_model("llama", 4, 2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "tiny-qwen2": lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir()).eval(),
}


def reference_and_fast_logits(model, steps=12, fuse=True, monkeypatch=None, device="cpu"):
    """Logits of ``steps`` one-token steps through transformers and through StaticDecoder (on
    ``device``: tests/test_cuda.py runs it on a GPU)."""
    ids, mask = (t.to(device) for t in left_pad(PROMPTS, 0))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(3, 300, (len(PROMPTS), steps), generator=torch.Generator().manual_seed(1)).to(device)
    if not fuse:
        monkeypatch.setattr(fast_decode, "FUSE_LIMIT_BYTES", 0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        fast = fast_decode.StaticDecoder(model, _output_cache(out), mask, positions[:, -1] + 1, steps)
        assert ("qkv" in fast.layers[0]) == fuse or device != "cpu"
        cache, attention, position, ref, got = _output_cache(out), mask, positions[:, -1:] + 1, [], []
        for t in range(steps):
            got.append(fast.step(tokens[:, t]))
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            step = model(input_ids=tokens[:, t:t + 1], attention_mask=attention, position_ids=position,
                         use_cache=True, **{_cache_kwarg(model): cache})
            cache, position = _output_cache(step), position + 1
            ref.append(step.logits[:, -1])
    return torch.stack(ref, 1), torch.stack(got, 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_steps_equal_transformers_steps(name):
    model = MODELS[name]()
    assert fast_decode.supports_static_decoding(model) is None
    ref, got = reference_and_fast_logits(model)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_unfused_projections_equal_transformers_steps(monkeypatch):
    ref, got = reference_and_fast_logits(MODELS["llama-bias"](), fuse=False, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bf16_steps_stay_close():
    ref, got = reference_and_fast_logits(small_model("qwen2", 4, 2, dtype=torch.bfloat16))
    assert float((got.float() - ref.float()).abs().max()) < 0.05 * (1 + float(ref.float().abs().max()))


def sample(model, backend, seeds=(1, 2, 3, 4)):
    ids, mask = left_pad(PROMPTS, 0)
    return generate(model, ids, mask, row_uniforms(list(seeds), 40), SamplingParams(40, 1.0, 0.9, 50), [0], 0,
                    backend=backend)


@pytest.mark.parametrize("name", ["qwen2-gqa", "llama-bias", "tiny-qwen2"])
def test_sampled_tokens_equal_the_transformers_loop(name):
    model = MODELS[name]()
    assert torch.equal(sample(model, "auto"), sample(model, "hf"))


def test_unsupported_models_use_the_transformers_loop():
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind="gpt2")).eval()
    assert "gpt2" in fast_decode.supports_static_decoding(gpt2)
    assert fast_decode.static_decoder_for(gpt2, None, torch.ones(1, 1), torch.zeros(1), 4) is None
    sliding = small_model("qwen2", 4, 2, use_sliding_window=True, sliding_window=8)
    assert "sliding" in fast_decode.supports_static_decoding(sliding)


def test_a_disagreeing_step_falls_back_for_good(monkeypatch, caplog):
    model = MODELS["qwen2-gqa"]()
    expected = sample(model, "hf")
    original = fast_decode.StaticDecoder.step
    monkeypatch.setattr(fast_decode.StaticDecoder, "step", lambda self, tokens: original(self, tokens) + 1.0)
    with caplog.at_level(logging.WARNING, logger="comlrl"):
        first = sample(model, "auto")
    assert "disagrees with the transformers forward" in caplog.text
    assert torch.equal(first, expected)  # the failed check's step and every later one came from transformers
    assert torch.equal(sample(model, "auto"), expected)
    assert fast_decode.needs_check(model) is False


# --------------------------------------------------------------------------------------------
# several agents decoding stacked
# --------------------------------------------------------------------------------------------

def two_agents(perturb=True):
    path = tiny_model_dir()
    models = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
    if perturb:
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in models[1].parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    from transformers import AutoTokenizer

    return models, AutoTokenizer.from_pretrained(path)


AGENT_PROMPTS = [["Describe a city in the clouds:", "Hi"], ["Invent a new holiday and explain it, please:", "Yo"]]
AGENT_SEEDS = [[[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 10, 11, 12], [13, 14, 15, 16]]]


@pytest.mark.parametrize("top_p,eos", [(1.0, [[0], [0]]), (0.9, [[0], [0, 7, 9]])])
def test_stacked_agents_equal_each_agent_alone(top_p, eos):
    """Different weights, prompt lengths and EOS sets per agent: the same completions, with each
    agent's own length, as one rollout per agent."""
    from comlrl.rollout.transformers_loop import rollout, rollout_agents

    models, tok = two_agents()
    assert fast_decode.stackable(models)
    params = SamplingParams(48, 1.0, top_p, 50)
    together = rollout_agents(models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, eos, [True, True])
    alone = [rollout(m, tok, p, s, params, e) for m, p, s, e in zip(models, AGENT_PROMPTS, AGENT_SEEDS, eos)]
    for x, y in zip(together, alone):
        assert torch.equal(x.completion_ids, y.completion_ids) and x.texts == y.texts
        assert torch.equal(x.prompt_ids, y.prompt_ids) and torch.equal(x.completion_mask, y.completion_mask)


def test_stacked_steps_equal_transformers_steps():
    models, _ = two_agents()
    ids, mask = left_pad(PROMPTS, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(3, 500, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        outs = [m(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
                for m in models]
        stacked = fast_decode.StackedDecoder(models, [_output_cache(o) for o in outs], [mask, mask],
                                             [positions[:, -1] + 1] * 2, 6)
        singles = [fast_decode.StaticDecoder(m, _output_cache(m(input_ids=ids, attention_mask=mask,
                                                                 position_ids=positions, use_cache=True)),
                                             mask, positions[:, -1] + 1, 6) for m in models]
        for t in range(6):
            both = stacked.step(torch.stack([tokens[:, t]] * 2))
            for a in range(2):
                torch.testing.assert_close(both[a], singles[a].step(tokens[:, t]), rtol=1e-5, atol=1e-5)


def test_what_cannot_stack_decodes_agent_by_agent():
    models, _ = two_agents()
    assert not fast_decode.stackable(models[:1])
    assert not fast_decode.stackable([models[0], models[0]])
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir(hidden_size=32))
    assert not fast_decode.stackable([models[0], other])
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind="gpt2"))
    assert not fast_decode.stackable([gpt2, AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind="gpt2"))])


def test_a_disagreeing_agent_sends_the_turn_back_to_one_rollout_per_agent(monkeypatch, caplog):
    from comlrl.rollout.transformers_loop import rollout, rollout_agents

    models, tok = two_agents()
    params = SamplingParams(24, 1.0, 1.0, 50)
    expected = [rollout(m, tok, p, s, params, [0], backend="hf")
                for m, p, s in zip(models, AGENT_PROMPTS, AGENT_SEEDS)]
    for m in models:
        fast_decode._VERIFIED.pop(m, None)
    original = fast_decode.StackedDecoder.step
    monkeypatch.setattr(fast_decode.StackedDecoder, "step", lambda self, tokens: original(self, tokens) + 1.0)
    single = fast_decode.StaticDecoder.step  # the agent not checked yet then fails its own check
    monkeypatch.setattr(fast_decode.StaticDecoder, "step", lambda self, tokens: single(self, tokens) + 1.0)
    with caplog.at_level(logging.WARNING, logger="comlrl"):
        got = rollout_agents(models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, [[0], [0]], [True, True])
    assert "disagrees" in caplog.text
    assert not fast_decode.stackable(models) and all(fast_decode._VERIFIED[m] is False for m in models)
    for x, y in zip(got, expected):
        assert torch.equal(x.completion_ids, y.completion_ids)


def test_concurrent_agents_sample_what_they_sample_one_after_another():
    """The threaded path (agents on separate GPUs) forced on CPU: same completions."""
    from comlrl.rollout.transformers_loop import rollout_agents

    models, tok = two_agents()
    params = SamplingParams(24, 1.0, 1.0, 50)
    args = (models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, [[0], [0]], [True, True], "hf")
    one_by_one = rollout_agents(*args, concurrent=False)
    together = rollout_agents(*args, concurrent=True)
    for x, y in zip(one_by_one, together):
        assert torch.equal(x.completion_ids, y.completion_ids) and x.texts == y.texts


def test_concurrent_agents_keep_the_callers_autocast():
    """Autocast is per thread: the workers must run under the caller's, or bf16 runs would sample
    in float32 on multi-GPU setups."""
    from comlrl.rollout.transformers_loop import rollout_agents

    models, tok = two_agents()
    params = SamplingParams(24, 1.0, 1.0, 50)
    args = (models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, [[0], [0]], [True, True], "hf")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one_by_one = rollout_agents(*args, concurrent=False)
        together = rollout_agents(*args, concurrent=True)
    for x, y in zip(one_by_one, together):
        assert torch.equal(x.completion_ids, y.completion_ids)


def test_a_row_samples_the_same_token_whatever_shares_its_batch():
    """Rows with a tie at the k-th score take the full path, the others the fast one, row by row."""
    from comlrl.rollout import sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g).round(decimals=1)  # many ties, some at the k-th score
    uniforms = torch.rand(6, generator=g, dtype=torch.float64)
    together = sample_tokens(logits, uniforms, 1.0, 0.8, 5)
    alone = torch.cat([sample_tokens(logits[i:i + 1], uniforms[i:i + 1], 1.0, 0.8, 5) for i in range(6)])
    assert torch.equal(together, alone)


def test_models_the_lean_step_cannot_read_directly_are_refused():
    """Adapters injected in place keep the base weight in ``.weight`` and hooks change outputs: the
    lean step would silently skip both, so such models keep the transformers forward."""
    from peft import LoraConfig, inject_adapter_in_model

    injected = inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"]), MODELS["qwen2-gqa"]())
    assert "adapters" in fast_decode.supports_static_decoding(injected)
    hooked = MODELS["qwen2-gqa"]()
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    assert "hooks" in fast_decode.supports_static_decoding(hooked)


def test_a_failing_stacked_batch_is_sampled_agent_by_agent(monkeypatch, caplog):
    from comlrl.rollout.transformers_loop import rollout, rollout_agents

    models, tok = two_agents()
    params = SamplingParams(16, 1.0, 1.0, 50)
    expected = [rollout(m, tok, p, s, params, [0]) for m, p, s in zip(models, AGENT_PROMPTS, AGENT_SEEDS)]

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(fast_decode, "StackedDecoder", broken)
    with caplog.at_level(logging.WARNING, logger="comlrl"):
        got = rollout_agents(models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, [[0], [0]], [True, True])
    assert "sampling agent by agent" in caplog.text
    for x, y in zip(got, expected):
        assert torch.equal(x.completion_ids, y.completion_ids)


def test_rotary_tables_built_step_by_step_when_large_give_the_same_steps(monkeypatch):
    """Above ROTARY_TABLES_BYTES the per-step rotary tables are expanded one step at a time (memory
    stays rows x T x head_dim); the logits are the same as with all steps built up front."""
    model = MODELS["qwen2-gqa"]()
    _, up_front = reference_and_fast_logits(model)
    monkeypatch.setattr(fast_decode, "ROTARY_TABLES_BYTES", 0)
    reference, step_by_step = reference_and_fast_logits(model)
    assert torch.equal(up_front, step_by_step)
    torch.testing.assert_close(step_by_step, reference, rtol=1e-4, atol=1e-4)


def lora_agents(kind="qwen2-gqa", targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")):
    """Two comlrl LoRA agents on one small base, with non-zero B (peft starts B at 0, a no-op) that
    differs per agent, and one adapter over only some projections (the rest read as their base)."""
    from peft import LoraConfig

    from comlrl.adapters import build_lora_agents

    torch.manual_seed(3)
    agents = build_lora_agents(MODELS[kind](), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                                          lora_dropout=0.0), 2)
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for agent in agents:
            for name, p in agent.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    agents[0].shared.eval()
    return agents


@pytest.mark.parametrize("fuse", [True, False])
def test_lora_agents_take_the_lean_step_and_equal_the_peft_forward(fuse, monkeypatch):
    """The steps add each adapter as peft does (unfused) or merged into the fused copy (fused): the
    same function, so logits agree to float32 rounding of products of this size (~1e-6)."""
    from comlrl.rollout.transformers_loop import explain_decoder

    agents = lora_agents()
    base_before = {k: v.clone() for k, v in agents[0].get_base_model().state_dict().items()}
    for agent in agents:
        assert fast_decode.supports_static_decoding(agent) is None and explain_decoder(agent) is None
        ref, got = reference_and_fast_logits(agent, fuse=fuse, monkeypatch=monkeypatch)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the adapters matter (a decoder that skipped them would fail above) and nothing was merged in place
    ref_0, _ = reference_and_fast_logits(agents[0], fuse=fuse, monkeypatch=monkeypatch)
    ref_1, _ = reference_and_fast_logits(agents[1], fuse=fuse, monkeypatch=monkeypatch)
    assert (ref_0 - ref_1).abs().max() > 1e-2
    for k, v in agents[0].get_base_model().state_dict().items():
        assert torch.equal(v, base_before[k]), k


def test_stacked_lora_agents_equal_each_agent_alone():
    agents = lora_agents()
    assert fast_decode.stackable(agents)
    ids, mask = left_pad(PROMPTS, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = torch.randint(3, 300, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        caches = [[_output_cache(a(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                   logits_to_keep=1)) for a in agents] for _ in range(2)]
        stacked = fast_decode.StackedDecoder(agents, caches[0], [mask, mask], [positions[:, -1] + 1] * 2, 6)
        singles = [fast_decode.StaticDecoder(a, c, mask, positions[:, -1] + 1, 6) for a, c in zip(agents, caches[1])]
        for t in range(6):
            both = stacked.step(torch.stack([tokens[:, t]] * 2))
            for a in range(2):
                torch.testing.assert_close(both[a], singles[a].step(tokens[:, t]), rtol=1e-5, atol=1e-5)


def test_adapters_the_lean_step_cannot_compute_keep_the_transformers_forward():
    """DoRA (a per-column magnitude the steps do not apply) and merged adapters (the base weight
    already holds the update) are refused rather than computed wrongly."""
    from peft import LoraConfig

    from comlrl.adapters import build_lora_agents

    dora = build_lora_agents(MODELS["qwen2-gqa"](), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), 1)
    assert fast_decode.supports_static_decoding(dora[0]) is not None
    agent = lora_agents()[0]
    agent.activate()
    agent.shared.merge_adapter()
    assert fast_decode.supports_static_decoding(agent) is not None
