"""Actor-critic math against slow, obvious references, and the value-head model."""

import math
import random

import pytest
import torch

from comlrl.exceptions import ConfigError
from comlrl.functional.values import group_moments, normalize_advantages, td_targets, value_errors
from comlrl.models.actor_critic import ActorCriticOutput, CausalLMWithValueHead, ValueHead


def _random_tree(rng, turns, k, roots):
    """Per turn: rewards, values and children of a random episode tree (some branches end early)."""
    rewards, values, children = [], [], []
    nodes = roots
    for t in range(turns):
        rows = nodes * k
        rewards.append(torch.tensor([rng.uniform(-1, 1) for _ in range(rows)], dtype=torch.float64))
        values.append(torch.tensor([rng.uniform(-1, 1) for _ in range(rows)], dtype=torch.float64))
        kids, count = [], 0
        for _ in range(rows):
            if t < turns - 1 and rng.random() < 0.7:
                kids.append(count)
                count += 1
            else:
                kids.append(None)
        children.append(kids)
        if count == 0:
            break
        nodes = count
    return rewards, values, children


def _td_reference(rewards, values, children, k, discount, turns):
    out = []
    for t in range(len(rewards)):
        row = []
        for r in range(len(rewards[t])):
            child = children[t][r]
            if child is None:
                horizon = sum(discount ** i for i in range(turns - t))
                row.append(float(rewards[t][r]) * horizon)
            else:
                nxt = sum(float(values[t + 1][child * k + j]) for j in range(k)) / k
                row.append(float(rewards[t][r]) + discount * nxt)
        out.append(row)
    return out


@pytest.mark.parametrize("k, discount", [(1, 1.0), (1, 0.9), (3, 0.5)])
def test_td_targets_match_the_reference(k, discount):
    rng = random.Random(k * 10 + int(discount * 10))
    for _ in range(20):
        rewards, values, children = _random_tree(rng, turns=3, k=k, roots=rng.randint(1, 3))
        got = td_targets(rewards, values, children, k, discount, num_turns=3)
        want = _td_reference(rewards, values, children, k, discount, 3)
        for g, w in zip(got, want):
            assert g.tolist() == pytest.approx(w, abs=1e-12)


def test_td_target_of_a_single_turn_is_the_reward():
    r = torch.tensor([0.3, -0.2], dtype=torch.float64)
    assert td_targets([r], [torch.tensor([5.0, 6.0])], [[None, None]], 1, 0.9)[0].tolist() == r.tolist()


def _normalize_reference(adv, groups):
    out = []
    for a, g in zip(adv.tolist(), groups.tolist()):
        members = [x for x, h in zip(adv.tolist(), groups.tolist()) if h == g]
        if len(members) == 1:
            out.append(a)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        out.append((a - mean) / max(std, 1e-6))
    return out


def test_normalized_advantages_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(17, generator=gen, dtype=torch.float64) * 3 + 1
    groups = torch.tensor([0] * 8 + [1] * 8 + [2])  # group 2 has one sample: left as it is
    got = normalize_advantages(adv, groups)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(_normalize_reference(adv, groups), abs=1e-5)


def test_normalization_from_summed_shard_moments_equals_the_whole():
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(12, generator=gen, dtype=torch.float64)
    groups = torch.tensor([0, 1] * 6)
    whole = normalize_advantages(adv, groups)
    moments = group_moments(adv[:5], groups[:5], 2) + group_moments(adv[5:], groups[5:], 2)
    shards = torch.cat([normalize_advantages(adv[:5], groups[:5], moments),
                        normalize_advantages(adv[5:], groups[5:], moments)])
    assert torch.allclose(shards, whole, atol=1e-6)


def test_equal_advantages_stay_finite():
    adv = torch.full((4,), 0.25, dtype=torch.float64)
    assert normalize_advantages(adv, torch.zeros(4, dtype=torch.long)).tolist() == [0.0] * 4


@pytest.mark.parametrize("clip", [None, 0.0, 0.1, 10.0])
def test_value_errors_match_the_reference(clip):
    gen = torch.Generator().manual_seed(2)
    values, old, target = (torch.randn(9, generator=gen) for _ in range(3))
    got = value_errors(values, old, target, clip)
    for v, o, y, e in zip(values.tolist(), old.tolist(), target.tolist(), got.tolist()):
        plain = (v - y) ** 2
        if clip is None:
            assert e == pytest.approx(plain, rel=1e-5)
        else:
            clipped = o + min(max(v - o, -clip), clip)
            assert e == pytest.approx(max(plain, (clipped - y) ** 2), rel=1e-5, abs=1e-7)


def test_clipped_value_loss_stops_the_gradient_beyond_the_clip():
    values = torch.tensor([1.0], requires_grad=True)
    # old 0, target 2: moving from 0 to 1 is beyond the clip 0.2, and the clipped error is larger.
    value_errors(values, torch.tensor([0.0]), torch.tensor([2.0]), 0.2).sum().backward()
    assert values.grad.item() == 0.0


# --- the model --------------------------------------------------------------------------------------

def _gpt2(vocab=40, width=16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=width, n_layer=1, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def test_value_head_shapes_and_init():
    head = ValueHead(16, 8)
    assert [k for k in head.state_dict()] == ["pre_projection.0.weight", "pre_projection.0.bias",
                                              "value_projection.weight", "value_projection.bias"]
    assert head(torch.zeros(3, 5, 16)).shape == (3, 5, 1)
    assert float(head.value_projection.bias.detach().abs().sum()) == 0.0
    assert ValueHead(16, 0).pre_projection is None  # 0 = no hidden layer (CoMLRL reads it so)
    with pytest.raises(ConfigError, match="hidden_dim"):
        ValueHead(16, -1)


def test_causal_lm_with_value_head_forward():
    model = CausalLMWithValueHead(_gpt2())
    ids = torch.randint(0, 40, (2, 7))
    out = model(input_ids=ids)
    assert isinstance(out, ActorCriticOutput)
    assert out.logits.shape == (2, 7, 40) and out.values.shape == (2, 7) and out.hidden_states.shape == (2, 7, 16)
    plain = model(input_ids=ids, output_values=False)
    assert plain.values is None and torch.equal(plain.logits, out.logits)
    assert [k.split(".")[0] for k in model.state_dict()][-1] == "value_head"
    assert CausalLMWithValueHead(_gpt2(), attach_value_head=False).value_head is None


def test_value_head_takes_the_backbone_dtype():
    model = CausalLMWithValueHead(_gpt2().to(torch.bfloat16))
    assert model.value_head.value_projection.weight.dtype == torch.bfloat16


def test_save_and_load_keep_the_head(tmp_path):
    model = CausalLMWithValueHead(_gpt2(), value_head_hidden_dim=4)
    with torch.no_grad():
        model.value_head.value_projection.bias.fill_(0.5)
    model.save_pretrained(tmp_path / "m")
    assert {"value_head.safetensors", "value_head.json", "value_head.pt", "config.json"} <= {
        p.name for p in (tmp_path / "m").iterdir()}
    loaded = CausalLMWithValueHead.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, 40, (1, 5))
    assert torch.allclose(loaded(input_ids=ids).values, model(input_ids=ids).values)
    legacy = torch.load(tmp_path / "m" / "value_head.pt", weights_only=True)  # CoMLRL's documented reload
    assert torch.equal(legacy["value_projection.bias"], model.value_head.value_projection.bias.detach())


def test_a_model_without_a_hidden_size_is_refused():
    with pytest.raises(ConfigError, match="config"):
        CausalLMWithValueHead(torch.nn.Linear(2, 2))
