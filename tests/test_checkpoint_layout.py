"""Every folder of a checkpoint loads in the tools people use (from_pretrained, PEFT, the value-model
loader) and equals the live module; checkpoints of the earlier format 2 still resume, value for
value; `comlrl export` needs nothing but the checkpoint and never replaces what it did not write."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl import ConfigError
from comlrl.checkpoint.export import MARKER, export_checkpoint
from comlrl.exceptions import CheckpointError
from comlrl.models.actor_critic import CausalLMWithValueHead
from comlrl.testing import SEED_PROMPTS, length_ratio_reward
from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

FIXTURES = Path(__file__).parent / "fixtures" / "format2"
IDS = torch.tensor([[5, 9, 2, 7, 11]])
ONE_EPOCH = dict(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=6, agent_learning_rate=1e-2,
                 temperature=1.0, top_p=1.0, eval_interval=0, weight_decay=0.0)


def _data():
    return [{"prompt": p} for p in SEED_PROMPTS]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def _trained(tmp_path, kind, model_path):
    """A run of ``kind`` trained one epoch with a checkpoint; returns (trainer, checkpoint-1)."""
    common = dict(agent_model=str(model_path), reward_func=length_ratio_reward, train_dataset=_data())
    out = str(tmp_path / "out")
    if kind in ("magrpo", "lora"):
        trainer = MAGRPOTrainer(num_agents=2, args=MAGRPOConfig(**ONE_EPOCH, output_dir=out),
                                peft_config=_lora() if kind == "lora" else None, **common)
    elif kind == "maac":
        trainer = MAACTrainer(critic_model=str(model_path), args=MAACConfig(**{**ONE_EPOCH, "num_generations": 1},
                                                                          output_dir=out), **common)
    else:
        settings = {**ONE_EPOCH, "num_generations": 1, "output_dir": out}
        trainer = IACTrainer(critic_model=str(model_path), args=IACConfig(**settings), **common) if kind == "iac" \
            else IACTrainer(args=IACConfig(use_separate_critic=False, **settings), **common)
    trainer.train(checkpoint_dir=tmp_path / "run")
    return trainer, tmp_path / "run" / "checkpoint-1"


def _weight_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors" and p.name != "optimizer.safetensors")


def test_full_agents_are_from_pretrained_folders(tmp_path, model_path, tokenizer):
    trainer, checkpoint = _trained(tmp_path, "magrpo", model_path)
    for i, agent in enumerate(trainer.agents):
        folder = checkpoint / f"agent-{i}"
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(loaded(IDS).logits, agent(IDS).logits, rtol=0, atol=0)  # the same weights
        assert AutoTokenizer.from_pretrained(folder)("a city in the clouds").input_ids == \
            tokenizer("a city in the clouds").input_ids
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"
        assert (folder / "generation_config.json").is_file()
        # One copy of the weights: tied embeddings stored once, under the name save_pretrained keeps
        # (vLLM and other loaders read the input embedding and tie the head to it).
        assert _weight_files(folder) == ["model.safetensors"]
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            keys = set(handle.keys())
            assert handle.metadata()["format"] == "pt"
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
        assert keys == set(agent.state_dict()) - {"lm_head.weight"}


def test_a_save_hashes_each_file_once(tmp_path, model_path, monkeypatch):
    from comlrl.checkpoint import files

    hashed = []  # each file's path inside the checkpoint being written

    def counted(path):
        parts = Path(path).parts
        start = next(i for i, part in enumerate(parts) if part.startswith(".tmp-checkpoint-")) + 1
        hashed.append("/".join(parts[start:]))
        return original(path)

    original = files._sha256
    monkeypatch.setattr(files, "_sha256", counted)
    _, checkpoint = _trained(tmp_path, "magrpo", model_path)
    listed = json.loads((checkpoint / files.MANIFEST_FILE).read_text())["files"]
    assert sorted(hashed) == sorted(rel for rel in listed if rel.endswith(".safetensors"))  # each once


def test_lora_agents_are_peft_adapter_folders(tmp_path, model_path):
    from peft import PeftModel

    trainer, checkpoint = _trained(tmp_path, "lora", model_path)
    for i, agent in enumerate(trainer.agents):
        folder = checkpoint / f"agent-{i}"
        assert _weight_files(folder) == ["adapter_model.safetensors"]  # the adapter only, never the base again
        config = json.loads((folder / "adapter_config.json").read_text())
        assert Path(config["base_model_name_or_path"]) == Path(model_path) and config["r"] == 4
        want = agent(IDS).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), folder)
        torch.testing.assert_close(peft_model(IDS).logits, want, rtol=0, atol=0)
        # transformers' PEFT integration finds the base through adapter_config.json
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(folder)(IDS).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["iac", "iac-shared", "maac"])
def test_value_models_load_with_their_heads(tmp_path, model_path, kind):
    trainer, checkpoint = _trained(tmp_path, kind, model_path)
    slots = trainer.trained_slots().modules
    value_slots = [s for s in slots if s.startswith("critic")] if kind != "iac-shared" else list(slots)
    for slot in value_slots:
        folder = checkpoint / slot
        assert _weight_files(folder) == ["model.safetensors", "value_head.safetensors"]
        loaded = CausalLMWithValueHead.from_pretrained(folder)
        torch.testing.assert_close(loaded(IDS).values, slots[slot](IDS).values, rtol=0, atol=0)
        # the backbone alone is a plain transformers folder too
        AutoModelForCausalLM.from_pretrained(folder)
    folders = json.loads((checkpoint / "trainer_state.json").read_text())["folders"]
    expected = {"iac": {"critic-0": "agent_0/critic", "critic-1": "agent_1/critic"}, "maac": {"critic-0": "critic"},
                "iac-shared": {}}[kind]
    assert folders == {"agent-0": "agent_0", "agent-1": "agent_1", **expected}


def _digests(trainer):
    slots = trainer.trained_slots()
    out = {}
    for slot, module in slots.modules.items():
        out.update({f"{slot}.param.{n}": hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
                    for n, p in module.state_dict().items()})
    for slot, opt in slots.optimizers.items():
        for index, state in opt.state_dict()["state"].items():
            out.update({f"{slot}.opt.{index}.{k}": hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                        for k, v in state.items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("run", ["magrpo", "lora", "iac"])
def test_format2_checkpoints_still_resume_exactly(tmp_path, run):
    """Checkpoints written before the folders became loadable (tests/fixtures/make_format2_checkpoint.py,
    run with the comlrl of commit 9794056) load value for value and train on into format-3 checkpoints."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_format2", FIXTURES.parent / "make_format2_checkpoint.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    source = tmp_path / "source"
    shutil.copytree(FIXTURES, source)  # the run continues in its own directory: work on a copy
    expected = json.loads((FIXTURES / "expected.json").read_text())["runs"][run]
    trainer = maker.build(run, source / "model", tmp_path / "out")
    trainer.args.num_train_epochs = 2
    assert trainer.load_checkpoint(source / run / "checkpoint-1")["epoch"] == 1
    assert _digests(trainer) == expected
    trainer.train(checkpoint_dir=source / run)
    assert json.loads((source / run / "checkpoint-2" / "manifest.json").read_text())["format_version"] == 3
    assert (source / run / "checkpoint-2" / "agent-0" / "tokenizer.json").is_file()


# --- export ------------------------------------------------------------------------------------------

def test_export_needs_only_the_checkpoint(tmp_path, model_path):
    trainer, checkpoint = _trained(tmp_path, "iac", model_path)
    out = tmp_path / "final"
    assert export_checkpoint(checkpoint, out) == ["agent_0", "agent_1"]
    for i, agent in enumerate(trainer.agents):
        loaded = AutoModelForCausalLM.from_pretrained(out / f"agent_{i}")
        torch.testing.assert_close(loaded(IDS).logits, agent(IDS).logits, rtol=0, atol=0)
        critic = CausalLMWithValueHead.from_pretrained(out / f"agent_{i}" / "critic")
        torch.testing.assert_close(critic(IDS).values, trainer.critics[i](IDS).values, rtol=0, atol=0)
        assert not (out / f"agent_{i}" / "optimizer.safetensors").exists()
    export_checkpoint(checkpoint, out)  # an earlier export is replaced


def test_export_never_replaces_what_it_did_not_write(tmp_path, model_path):
    _, checkpoint = _trained(tmp_path, "magrpo", model_path)
    own = tmp_path / "mine"
    (own / "agent_0").mkdir(parents=True)
    (own / "agent_0" / "notes.txt").write_text("my own work")
    with pytest.raises(ConfigError, match="already holds files export did not write"):
        export_checkpoint(checkpoint, own)
    assert (own / "agent_0" / "notes.txt").read_text() == "my own work"
    earlier = tmp_path / "earlier"
    export_checkpoint(checkpoint, earlier)
    (earlier / "agent_1" / "README.md").write_text("added by hand")  # no longer only what export wrote
    with pytest.raises(ConfigError, match="already holds files export did not write"):
        export_checkpoint(checkpoint, earlier)
    assert (earlier / "agent_1" / "README.md").is_file() and (earlier / MARKER).is_file()
    with pytest.raises(ConfigError, match="already holds"):
        export_checkpoint(checkpoint, tmp_path)  # the directory holding the run itself


def test_export_merges_lora_agents_only_onto_the_runs_base(tmp_path, model_path):
    from comlrl.testing import tiny_model_dir

    trainer, checkpoint = _trained(tmp_path, "lora", model_path)
    export_checkpoint(checkpoint, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "agent_1")
    assert not (tmp_path / "merged" / "agent_1" / "adapter_config.json").exists()
    torch.testing.assert_close(merged(IDS).logits, trainer.agents[1](IDS).logits, rtol=1e-4, atol=1e-5)
    other = tiny_model_dir(seed=1)  # same architecture, other weights
    with pytest.raises(ConfigError, match="not the one the run trained on"):
        export_checkpoint(checkpoint, tmp_path / "wrong", merge=True,
                          base_loader=lambda name: AutoModelForCausalLM.from_pretrained(other))
    assert not (tmp_path / "wrong").exists()


def test_export_of_a_tampered_checkpoint_writes_nothing(tmp_path, model_path):
    _, checkpoint = _trained(tmp_path, "magrpo", model_path)
    (checkpoint / "agent-1" / "config.json").write_text("{}")  # a side file is hashed like the weights
    with pytest.raises(CheckpointError, match="agent-1/config.json"):
        export_checkpoint(checkpoint, tmp_path / "final")
    assert not (tmp_path / "final").exists()


def test_export_racing_checkpoint_pruning_is_a_clear_error(tmp_path, model_path, monkeypatch):
    """A checkpoint pruned by a running training while it is exported: a CheckpointError, no
    traceback, and nothing written (issue 29)."""
    import comlrl.checkpoint.export as export_module

    _, checkpoint = _trained(tmp_path, "magrpo", model_path)
    real_copy = export_module.shutil.copyfile

    def pruned_meanwhile(src, dst, **kwargs):
        if checkpoint.exists():
            shutil.rmtree(checkpoint)
        return real_copy(src, dst, **kwargs)
    monkeypatch.setattr(export_module.shutil, "copyfile", pruned_meanwhile)
    with pytest.raises(CheckpointError, match="disappeared while it was exported"):
        export_checkpoint(checkpoint, tmp_path / "final")
    assert not (tmp_path / "final").exists() and not list(tmp_path.glob(".tmp-export-*"))
    with pytest.raises(CheckpointError, match="does not exist"):
        export_checkpoint(checkpoint, tmp_path / "final")
