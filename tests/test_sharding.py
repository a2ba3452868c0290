"""Agents sharded with FSDP2 (sharding="fsdp2") on 2 gloo processes on CPU, against the unsharded run:
the same training within float tolerance, half of each agent per process, exact resume, resharding
on resume (2 -> 1, 1 -> 2), checkpoints whose folders from_pretrained loads, clear refusals."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from test_distributed import assert_close_runs, batch, final, finished, resumed, rows

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sharding")]  # one worker: the runs are made once

SHARDED = ("--sharding", "fsdp2")


UNEVEN = ("--extra-prompt", "--train-batch-size", "2", "--ppo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run this module's tests compare, in three launches (1, 2, then 1 process; one import
    each): with reference KL, unsharded on one process and sharded on two, for 2 and 4 epochs;
    resumed for 4 epochs from each one's 2-epoch checkpoint, sharded (2 -> 2, 1 -> 2) and unsharded
    (2 -> 1); the uneven run; and one bf16 epoch sharded."""
    root = tmp_path_factory.mktemp("shard")
    batch(root, [(root / "one", "--kl", "0.05"),                       # one process, every agent whole
                 (root / "one-4", "--kl", "0.05", "--epochs", "4"),
                 (root / "uneven" / "one", *UNEVEN)], procs=1)
    batch(root, [(root / "two", "--kl", "0.05", *SHARDED),              # each agent (and its reference) over 2
                 (root / "two-4", "--kl", "0.05", "--epochs", "4", *SHARDED),
                 *resumed(root / "two", root / "two-resumed", "--kl", "0.05", "--epochs", "4", *SHARDED),
                 *resumed(root / "one", root / "one-on-two", "--kl", "0.05", "--epochs", "4", *SHARDED),
                 (root / "uneven" / "two", *UNEVEN, *SHARDED),
                 (root / "bf16", "--epochs", "1", "--mixed-precision", "bf16", *SHARDED)], procs=2)
    batch(root, [*resumed(root / "two", root / "two-on-one", "--kl", "0.05", "--epochs", "4")], procs=1)
    return root


def test_sharded_training_equals_unsharded(runs):
    assert_close_runs(finished(runs / "one"), finished(runs / "two", procs=2))
    assert [r["global_step"] for r in rows(runs / "two")] == [1, 2]


def test_each_process_holds_half_of_each_agent(runs):
    """Parameters and AdamW moments: FSDP2 splits every tensor along its first dimension, padded, so
    a process of two holds about half (asserted within 0.4-0.6)."""
    for rank in (0, 1):
        record = json.loads((finished(runs / "two", procs=2) / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2
        for fraction in record["params_fraction"] + record["moments_fraction"]:
            assert 0.4 <= fraction <= 0.6, record


def test_sharded_resume_is_exact(runs):
    a, b = (finished(runs / name, procs=2) for name in ("two-4", "two-resumed"))
    wa, wb = final(a), final(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert rows(a) == rows(b)


def test_a_sharded_checkpoint_resumes_unsharded_on_one_process(runs):
    other = finished(runs / "two-on-one")
    assert "written by 2 process(es) and resumes on 1" in (other / "log-rank0.txt").read_text()
    assert_close_runs(finished(runs / "two-4", procs=2), other)


def test_an_unsharded_checkpoint_resumes_sharded_on_two_processes(runs):
    assert_close_runs(finished(runs / "one-4"), finished(runs / "one-on-two", procs=2))


def test_a_sharded_checkpoint_is_an_ordinary_one(runs, tmp_path):
    """Its folders load with from_pretrained, and export and save_model write from_pretrained folders."""
    from transformers import AutoModelForCausalLM

    from comlrl.checkpoint.export import export_checkpoint

    checkpoint = runs / "two" / "ckpt" / "checkpoint-2"
    weights = final(runs / "two")
    for source in (checkpoint / "agent-1", runs / "two" / "saved" / "agent_1"):
        model = AutoModelForCausalLM.from_pretrained(source)
        assert all(torch.equal(p, weights[f"agent-1.{n}"]) for n, p in model.named_parameters())
        assert json.loads((source / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    export_checkpoint(checkpoint, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / "agent_0")
    assert all(torch.equal(p, weights[f"agent-0.{n}"]) for n, p in exported.named_parameters())
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert "agent-0/model.safetensors" in listed and "agent-0/optimizer.safetensors" in listed
    assert not any(".dcp" in name or "sharded" in name for name in listed)
    assert sorted(load_file(str(checkpoint / "agent-0" / "optimizer.safetensors")))[0].split(".", 1)[1] in (
        "exp_avg", "exp_avg_sq", "step")


def test_uneven_shares_and_several_passes_per_buffer(runs):
    """5 prompts, 2 per step over 2 processes (the last step gives one process nothing), the
    clipped-ratio update with 2 passes: every process runs the same collectives (idle passes),
    and the run is the unsharded one within tolerance."""
    assert_close_runs(finished(runs / "uneven" / "one"), finished(runs / "uneven" / "two", procs=2))


def test_where_sharding_cannot_run_it_is_refused_before_models_load(model_path, tokenizer, monkeypatch):
    from peft import LoraConfig

    from comlrl import ConfigError, MAGRPOConfig, MAGRPOTrainer
    from comlrl.trainers.actor_critic import IACConfig, IACTrainer

    data = [{"prompt": "Say hi."}]
    with pytest.raises(ConfigError, match="IACTrainer does not run with sharding='fsdp2'"):
        IACTrainer(agent_model="no/such/model", critic_model="no/such/model", reward_func=lambda a, b: [0.0] * len(a),
                   train_dataset=data,
                   args=IACConfig(num_turns=1, num_generations=1, sharding="fsdp2"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="runs under torchrun"):
        MAGRPOTrainer(agent_model="no/such/model", reward_func=lambda a, b: [0.0] * len(a), train_dataset=data,
                      args=MAGRPOConfig(num_turns=1, sharding="fsdp2"))
    with pytest.raises(ConfigError, match="LoRA agents"):
        MAGRPOTrainer(agent_model="no/such/model", reward_func=lambda a, b: [0.0] * len(a), train_dataset=data,
                      peft_config=LoraConfig(r=2), args=MAGRPOConfig(num_turns=1, sharding="fsdp2"))
    with pytest.raises(ConfigError, match="rollout_backend='generate'"):
        MAGRPOConfig(sharding="fsdp2", rollout_backend="generate")
    with pytest.raises(ConfigError, match="sharding_group_size applies"):
        MAGRPOConfig(sharding_group_size=2)
    assert os.environ.get("WORLD_SIZE") is None


def test_sharded_bf16_uses_fsdp2_mixed_precision_policy(runs):
    """mixed_precision="bf16" with sharding="fsdp2": FSDP2's MixedPrecisionPolicy gathers each
    layer's parameters in bfloat16 for its forwards (seen inside them), while the sharded
    masters and AdamW stay float32; training takes finite steps."""
    from comlrl.engine.sharding import mixed_precision_policy

    policy = mixed_precision_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(None) is None
    bf16 = finished(runs / "bf16", procs=2)
    for rank in (0, 1):
        record = json.loads((bf16 / f"rank{rank}.json").read_text())
        assert record["forward_dtypes"] == {"0": ["torch.bfloat16"], "1": ["torch.bfloat16"]}, record
        assert record["master_dtypes"] == ["torch.float32"]
    assert all(torch.isfinite(v).all() for v in final(bf16).values())
    assert [r["global_step"] for r in rows(bf16)] == [1]
