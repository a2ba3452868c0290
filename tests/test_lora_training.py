"""LoRA agents in the trainer: one shared base, adapter-only checkpoints that resume bit-exactly,
the base checked by fingerprint, KL to the base without a copy, save_model as adapter or merged."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from comlrl import MAGRPOConfig, MAGRPOTrainer, ResumeMismatchError
from comlrl.adapters import AdapterAgent
from comlrl.exceptions import ConfigError
from comlrl.testing import tiny_model_dir

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, never_stepped, rows, state_of

def three_agent_reward(completions1, completions2, completions3):
    return length_ratio_reward(completions1, completions3)


LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def lora_trainer(model_path, tokenizer, tmp_path, num_agents=2, peft_config=LORA, agent_model=None, **overrides):
    settings = dict(TEST_SETTINGS, num_train_epochs=2, max_new_tokens=12, agent_learning_rate=1e-2,
                    output_dir=str(tmp_path / "out"))
    settings.update(overrides)
    return MAGRPOTrainer(agent_model=agent_model or model_path, num_agents=num_agents, tokenizer=tokenizer,
                         peft_config=peft_config,
                         reward_func=three_agent_reward if num_agents == 3 else length_ratio_reward,
                         train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=MAGRPOConfig(**settings))


def test_agents_share_one_base_and_checkpoints_hold_adapters_only(model_path, tokenizer, tmp_path):
    trainer = lora_trainer(model_path, tokenizer, tmp_path, num_agents=3)
    assert all(isinstance(a, AdapterAgent) for a in trainer.agents)
    assert len({id(a.shared) for a in trainer.agents}) == 1
    base_params = sum(p.numel() for n, p in trainer.agents[0].shared.named_parameters() if "lora_" not in n)
    adapter_params = sum(p.numel() for p in trainer.agents[0].parameters())
    assert 0 < adapter_params < base_params / 4
    before = {n: p.detach().clone() for n, p in trainer.agents[0].shared.named_parameters() if "lora_" not in n}
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    after = dict(trainer.agents[0].shared.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base stays frozen
    for a, agent in enumerate(trainer.agents):  # every adapter learned
        assert not never_stepped(trainer.optimizers[a]), a
    saved = tmp_path / "ckpt" / "checkpoint-2"
    from safetensors.torch import load_file

    weights = load_file(str(saved / "agent-0" / "adapter_model.safetensors"))  # PEFT's adapter file
    assert weights and all("lora_" in k for k in weights)
    assert sum(t.numel() for t in weights.values()) == adapter_params
    state = json.loads((saved / "trainer_state.json").read_text())
    assert len(state["fingerprints"]["lora_bases"]) == 3


def test_lora_resume_is_bit_exact_and_another_base_is_refused(model_path, tokenizer, tmp_path):
    full = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=4)
    full.train(checkpoint_dir=tmp_path / "full")
    part = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=2)
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=4)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")
    other_base = tiny_model_dir(seed=1)  # same architecture, other weights
    other = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=4, agent_model=other_base)
    with pytest.raises(ResumeMismatchError, match="lora_bases"):
        other.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-2", checkpoint_dir=tmp_path / "part")


def test_kl_to_the_base_needs_no_copy(model_path, tokenizer, tmp_path):
    trainer = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=2, reference_kl_enabled=True,
                           reference_kl_coef=0.5)
    assert trainer.reference_models == [None, None]
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    logged = rows(tmp_path / "ckpt")
    assert logged[0]["agent_0/reference_kl"] == 0.0 and logged[-1]["agent_0/reference_kl"] != 0


def test_save_model_as_adapters_and_merged(model_path, tokenizer, tmp_path):
    trainer = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=1)
    trainer.train()
    ids = torch.tensor([[5, 17, 42, 9, 88]])
    with torch.no_grad():
        expected = [agent(input_ids=ids).logits for agent in trainer.agents]
    trainer.save_model(tmp_path / "adapters")
    trainer.save_model(tmp_path / "merged", merge_adapters=True)
    for i in range(2):
        base = AutoModelForCausalLM.from_pretrained(model_path)
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapters" / f"agent_{i}").eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / f"agent_{i}").eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected[i], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(merged(input_ids=ids).logits, expected[i], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected[0], expected[1])  # the two agents learned different adapters


def test_bad_lora_input_is_refused_at_construction(model_path, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="no_such_proj"):
        lora_trainer(model_path, tokenizer, tmp_path,
                     peft_config=LoraConfig(r=4, target_modules=["no_such_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ConfigError, match="agent_model"):
        MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                      tokenizer=tokenizer, peft_config=LORA, reward_func=length_ratio_reward,
                      train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=MAGRPOConfig(**TEST_SETTINGS))
    with pytest.raises(ConfigError, match="LoraConfig"):
        lora_trainer(model_path, tokenizer, tmp_path, peft_config={"r": 8})


def test_inits_that_do_not_start_at_the_base_are_refused(model_path, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="rewrites the base"):
        lora_trainer(model_path, tokenizer, tmp_path, peft_config=LoraConfig(
            r=4, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights="pissa"))
    random_b = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
    lora_trainer(model_path, tokenizer, tmp_path, peft_config=random_b)  # fine without KL
    with pytest.raises(ConfigError, match="do not start at the base"):
        lora_trainer(model_path, tokenizer, tmp_path, peft_config=random_b, reference_kl_enabled=True)


def test_a_changed_adapter_config_is_refused_on_resume(model_path, tokenizer, tmp_path):
    lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=1).train(checkpoint_dir=tmp_path / "ckpt")
    other = lora_trainer(model_path, tokenizer, tmp_path, num_train_epochs=2, peft_config=LoraConfig(
        r=4, lora_alpha=64, target_modules="all-linear", task_type="CAUSAL_LM"))
    with pytest.raises(ResumeMismatchError, match="lora_adapters"):
        other.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1", checkpoint_dir=tmp_path / "ckpt")
