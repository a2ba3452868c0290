"""comlrl.adapters: agents as LoRA adapters on one shared frozen base model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel  # noqa: E402
from safetensors.torch import load_file, load_model, save_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from comlrl.adapters import AdapterAgent, base_fingerprint, build_lora_agents  # noqa: E402
from comlrl.exceptions import ConfigError  # noqa: E402
from comlrl.checkpoint.fingerprint import model_fingerprint  # noqa: E402
from comlrl.functional import sequence_log_probs  # noqa: E402
from comlrl.rollout import SamplingParams, derive_seed, left_pad  # noqa: E402
from comlrl.rollout.transformers_loop import _cache_kwarg, rollout  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from helpers import SEED_PROMPTS  # noqa: E402

R = 4


def lora(**overrides) -> LoraConfig:
    settings = dict(r=R, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    settings.update(overrides)
    return LoraConfig(**settings)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path)


def make_agents(path, num_agents=2, seed=0, config=None):
    torch.manual_seed(seed)
    return build_lora_agents(load(path), config or lora(), num_agents)


@torch.no_grad()
def perturb(agents, scale=0.3):
    """Give every adapter distinct non-zero B matrices (B = 0 at init makes every agent the base)."""
    for i, agent in enumerate(agents):
        gen = torch.Generator().manual_seed(100 + i)
        for name, p in agent.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def batch(rows=3, length=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 500, (rows, length), generator=gen)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def logits_with(shared, name, inputs):
    shared.set_adapter(name)
    return shared(**inputs).logits


def expected_adapter_size(model, r):
    return sum(r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))


# --------------------------------------------------------------------------------------------
# one base in memory, one adapter per agent
# --------------------------------------------------------------------------------------------


def test_agents_share_one_base_and_own_only_their_adapter(model_path):
    base = load(model_path)
    ptrs = {n: p.data_ptr() for n, p in base.named_parameters()}
    size = expected_adapter_size(base, R)
    base_count = sum(p.numel() for p in base.parameters())
    agents = build_lora_agents(base, lora(), 3)

    shared = agents[0].shared
    assert all(a.shared is shared for a in agents) and isinstance(shared, PeftModel)
    assert [a.adapter_name for a in agents] == ["agent_0", "agent_1", "agent_2"]
    # Base weights were not copied: same storage before wrapping and under every agent.
    wrapped = {n.replace("base_model.model.", "", 1).replace(".base_layer", ""): p.data_ptr()
               for n, p in shared.named_parameters() if ".agent_" not in n}
    assert wrapped == ptrs
    assert sum(p.numel() for p in shared.parameters()) == base_count + 3 * size
    owned = [{id(p) for p in a.parameters()} for a in agents]
    for agent, ids in zip(agents, owned):
        assert sum(p.numel() for p in agent.parameters()) == size
        assert all(p.requires_grad for p in agent.parameters())
        assert ids <= {id(p) for p in shared.parameters()}  # the PeftModel's own Parameter objects
    assert not owned[0] & owned[1] and not owned[1] & owned[2]
    assert not any(p.requires_grad for n, p in shared.named_parameters() if ".agent_" not in n)
    # State dict keys: PEFT's adapter-file keys, the same for every agent.
    keys = list(agents[0].state_dict())
    assert keys[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert keys == list(agents[2].state_dict())


def test_forward_is_the_peft_model_with_that_adapter_and_zero_init_is_the_base(model_path):
    inputs = batch()
    base_logits = load(model_path)(**inputs).logits
    agents = make_agents(model_path, 2)
    for agent in agents:  # LoRA B = 0 at init: every agent computes the base
        torch.testing.assert_close(agent(**inputs).logits, base_logits, rtol=0, atol=0)
    perturb(agents)
    outs = [agent(**inputs).logits for agent in reversed(agents)][::-1]  # switch order reversed on purpose
    assert not torch.allclose(outs[0], outs[1])
    for agent, out in zip(agents, outs):
        torch.testing.assert_close(out, logits_with(agent.shared, agent.adapter_name, inputs), rtol=0, atol=0)
    with agents[1].reference() as ref:  # adapters disabled: the frozen base again
        torch.testing.assert_close(ref(**inputs).logits, base_logits, rtol=0, atol=0)
        torch.testing.assert_close(agents[0](**inputs).logits, base_logits, rtol=0, atol=0)
    torch.testing.assert_close(agents[1](**inputs).logits, outs[1], rtol=0, atol=0)
    assert all(p.requires_grad for a in agents for p in a.parameters())


def test_gradients_and_optimizer_steps_stay_in_one_agent(model_path):
    agents = make_agents(model_path, 2)
    perturb(agents)
    # The trainer's pattern: only trainable parameters go to the optimizer. peft's set_adapter would
    # leave every adapter but the last active one frozen; here all are trainable and all are kept.
    optimizers = [torch.optim.AdamW([p for p in a.parameters() if p.requires_grad], lr=1e-2) for a in agents]
    assert [len(o.param_groups[0]["params"]) for o in optimizers] == [len(list(a.parameters())) for a in agents]
    frozen_base = {n: p.detach().clone() for n, p in agents[0].shared.named_parameters() if ".agent_" not in n}
    before = [{k: v.clone() for k, v in a.state_dict().items()} for a in agents]

    agents[1](**batch()).logits.sum()  # agent 1 ran last: the switch back must not freeze agent 0
    agents[0](**batch()).logits.pow(2).mean().backward()
    assert all(p.grad is not None for p in agents[0].parameters())
    assert all(p.grad is None for p in agents[1].parameters())
    assert torch.nn.utils.clip_grad_norm_(agents[0].parameters(), 1.0) > 0
    optimizers[0].step()

    after = [a.state_dict() for a in agents]
    assert all(not torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    for n, p in agents[0].shared.named_parameters():
        if ".agent_" not in n:
            assert torch.equal(p, frozen_base[n]) and p.grad is None


def test_state_dict_round_trip_through_safetensors(model_path, tmp_path):
    agents = make_agents(model_path, 2)
    perturb(agents)
    inputs = batch()
    expected = agents[1](**inputs).logits
    save_model(agents[1], str(tmp_path / "agent.safetensors"))
    saved = load_file(str(tmp_path / "agent.safetensors"))
    assert set(saved) == set(agents[1].state_dict())

    other = make_agents(model_path, 2, seed=7)  # another "process": fresh base, other init
    params = list(other[0].parameters())
    missing, unexpected = load_model(other[0], str(tmp_path / "agent.safetensors"))
    assert not missing and not unexpected
    assert all(a is b for a, b in zip(params, other[0].parameters()))  # loaded in place: optimizers stay valid
    torch.testing.assert_close(other[0](**inputs).logits, expected, rtol=0, atol=0)


def test_save_pretrained_adapter_and_merged_round_trip(model_path, tmp_path):
    agents = make_agents(model_path, 2)
    perturb(agents)
    inputs = batch()
    expected = agents[1](**inputs).logits
    base_before = {n: p.detach().clone() for n, p in agents[0].shared.named_parameters()}

    adapter_dir = agents[1].save_pretrained(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    assert not any(p.is_dir() for p in adapter_dir.iterdir())  # no agent_1/ subfolder, no temp dir left
    assert set(load_file(str(adapter_dir / "adapter_model.safetensors"))) == set(agents[1].state_dict())
    reloaded = PeftModel.from_pretrained(load(model_path), str(adapter_dir))
    torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=0, atol=0)

    merged_dir = agents[1].save_pretrained(tmp_path / "merged", merged=True)
    assert (merged_dir / "config.json").is_file() and not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    torch.testing.assert_close(merged(**inputs).logits, expected, rtol=1e-4, atol=1e-5)

    for n, p in agents[0].shared.named_parameters():  # saving changed nothing in the shared model
        assert torch.equal(p, base_before[n]), n
    torch.testing.assert_close(agents[1](**inputs).logits, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# the sampler and the loss run unchanged on an agent
# --------------------------------------------------------------------------------------------


def test_rollout_and_log_probs_on_an_agent_equal_the_peft_model(model_path, tokenizer):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50)
    prompts = SEED_PROMPTS[:2]
    seeds = [[derive_seed(0, g, k) for k in range(3)] for g in range(len(prompts))]
    eos = [tokenizer.eos_token_id]
    plain = load(model_path)
    agents = make_agents(model_path, 2)
    # The KV-cache keyword is found through agent.get_base_model(); at init (B = 0) sampling with the
    # cache equals sampling from the plain base model.
    assert _cache_kwarg(agents[0]) == _cache_kwarg(plain)
    assert torch.equal(rollout(agents[1], tokenizer, prompts, seeds, params, eos).completion_ids,
                       rollout(plain, tokenizer, prompts, seeds, params, eos).completion_ids)
    perturb(agents, scale=0.5)
    agents[0].train()
    ours = [rollout(agent, tokenizer, prompts, seeds, params, eos) for agent in agents]
    assert agents[0].training and agents[1].training  # rollout's eval() then train(True) on the shared model
    assert not torch.equal(ours[0].completion_ids, ours[1].completion_ids)

    shared = agents[0].shared
    for agent, ro in zip(reversed(agents), reversed(ours)):
        shared.set_adapter(agent.adapter_name)
        theirs = rollout(shared, tokenizer, prompts, seeds, params, eos)
        assert torch.equal(ro.completion_ids, theirs.completion_ids) and ro.texts == theirs.texts
        logp = sequence_log_probs(agent, ro.prompt_ids, ro.prompt_mask, ro.completion_ids)
        shared.set_adapter(agent.adapter_name)
        expected = sequence_log_probs(shared, ro.prompt_ids, ro.prompt_mask, ro.completion_ids)
        torch.testing.assert_close(logp, expected, rtol=0, atol=0)
        assert logp.requires_grad


def test_reference_log_probs_are_the_base_model(model_path):
    base = load(model_path)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8], [9, 10]], pad_token_id=0)
    completion = torch.tensor([[11, 12, 13], [14, 15, 0]])
    expected = sequence_log_probs(base, prompt_ids, prompt_mask, completion)
    agents = make_agents(model_path, 2)
    perturb(agents)
    with torch.no_grad(), agents[0].reference():
        ref = sequence_log_probs(agents[0], prompt_ids, prompt_mask, completion)
    torch.testing.assert_close(ref, expected, rtol=1e-6, atol=1e-6)  # the base alone takes the fused-head path
    assert not torch.allclose(sequence_log_probs(agents[0], prompt_ids, prompt_mask, completion), expected)


# --------------------------------------------------------------------------------------------
# configuration errors, determinism, delegation, fingerprints
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, needles", [
    (lambda: lora(target_modules=["attn_qq", "mlp_zz"]), ["attn_qq", "q_proj", "v_proj", "all-linear"]),
    (lambda: {"r": 8, "target_modules": "all-linear"}, ["LoraConfig", "dict", "LoraConfig(**your_dict)"]),
    (lambda: lora(bias="all"), ["bias='none'"]),
    (lambda: lora(task_type="SEQ_CLS"), ["CAUSAL_LM"]),
])
def test_bad_configs_raise_config_error(model_path, config, needles):
    base = load(model_path)
    with pytest.raises(ConfigError) as info:
        build_lora_agents(base, config(), 2)
    for needle in needles:
        assert needle in str(info.value)
    assert not any("lora" in n for n, _ in base.named_modules())  # the base is left unwrapped


def test_bad_counts_and_double_wrapping_raise(model_path):
    agents = make_agents(model_path, 1)
    for count in (0, 1.5, True):
        with pytest.raises(ConfigError, match="num_agents"):
            build_lora_agents(load(model_path), lora(), count)
    with pytest.raises(ConfigError, match="already a PeftModel"):
        build_lora_agents(agents[0].shared, lora(), 2)
    with pytest.raises(ConfigError, match="agent_9"):
        AdapterAgent(agents[0].shared, "agent_9")


def test_initialisation_is_deterministic_under_a_seed(model_path):
    config = lora()
    first, second, other = make_agents(model_path, 2, 3, config), make_agents(model_path, 2, 3), \
        make_agents(model_path, 2, 4)
    assert config.target_modules == "all-linear"  # the caller's config is not modified
    for a, b in zip(first, second):
        assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    a_keys = [k for k in first[0].state_dict() if "lora_A" in k]
    assert not torch.equal(first[0].state_dict()[a_keys[0]], first[1].state_dict()[a_keys[0]])
    assert not torch.equal(first[0].state_dict()[a_keys[0]], other[0].state_dict()[a_keys[0]])


def test_delegation_and_model_fingerprint(model_path):
    base = load(model_path)
    agents = build_lora_agents(base, lora(), 2)
    agent = agents[1]
    assert agent.config is base.config and agent.generation_config is base.generation_config
    assert agent.get_input_embeddings() is base.get_input_embeddings()
    assert agent.device == torch.device("cpu") and agent.to("cpu") is agent
    agent.eval()
    assert not agents[0].training and not agent.shared.training
    agents[0].train()
    assert agent.training and base.training
    assert "agent_1" in repr(agent) and "Qwen2ForCausalLM" in repr(agent)
    record = model_fingerprint(agent)
    assert record["class"] == "AdapterAgent"
    assert record["config"] == model_fingerprint(load(model_path))["config"]
    assert record["parameters"] == model_fingerprint(agents[0])["parameters"]  # same adapter layout
    assert agent.fingerprint()["base"] == base_fingerprint(base)


FINGERPRINT_SCRIPT = """
import json, sys
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from comlrl.adapters import base_fingerprint, build_lora_agents
from comlrl.checkpoint.fingerprint import model_fingerprint
base = AutoModelForCausalLM.from_pretrained(sys.argv[1])
record = {"base": base_fingerprint(base)}
agent = build_lora_agents(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"), 2)[1]
record.update(agent=agent.fingerprint(), model=model_fingerprint(agent), keys=list(agent.state_dict()))
print(json.dumps(record))
"""


def test_base_fingerprint_identifies_the_base(model_path, tmp_path):
    plain = base_fingerprint(load(model_path))
    agents = make_agents(model_path, 2)
    perturb(agents)
    assert base_fingerprint(agents[0]) == base_fingerprint(agents[0].shared) == plain  # adapters ignored
    other_seed = base_fingerprint(load(tiny_model_dir(seed=1, cache_dir=tmp_path)))
    assert {k for k in plain if plain[k] != other_seed[k]} == {"content"}  # same architecture, other weights
    # Another process, another string-hash seed (peft keeps target_modules as a set): the same records.
    fresh = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT, str(model_path)], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    there = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert there == {"base": plain, "agent": agents[1].fingerprint(), "model": model_fingerprint(agents[1]),
                     "keys": list(agents[1].state_dict())}
