"""Checkpoints: layout, bit-exact resume (also mid-epoch and twice), what may change, refusals,
tampering, retention and the directory policy."""

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl import CheckpointDirError, CheckpointError, ConfigError, MAGRPOConfig, MAGRPOTrainer, ResumeMismatchError
from comlrl.testing import build_tiny_tokenizer, tiny_model_dir
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, rows, state_of


@pytest.fixture
def uninterrupted(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=4)
    trainer.train(checkpoint_dir=tmp_path / "full")
    return trainer, tmp_path / "full"


def test_checkpoints_per_epoch_and_metadata(uninterrupted):
    trainer, directory = uninterrupted
    assert sorted(p.name for p in directory.glob("checkpoint-*")) == [f"checkpoint-{i}" for i in range(1, 5)]
    meta = read_checkpoint_metadata(directory / "checkpoint-2")
    assert meta["checkpoint"] == meta["sequence"] == 2 and meta["epoch"] == 2
    assert meta["env_step"] == 32 and meta["global_step"] == 8 and meta["items_in_epoch"] == 0
    assert meta["wandb"] is None and meta["trainer_class"] == "MAGRPOTrainer" and len(meta["run_id"]) == 32
    assert find_latest_checkpoint(directory) == directory / "checkpoint-4"
    state = json.loads((directory / "checkpoint-2" / "trainer_state.json").read_text())
    assert set(state["fingerprints"]) >= {"config", "models", "tokenizers", "dataset", "reward_func"}
    assert set(state["rng"]) >= {"python", "numpy"}
    files = {p.relative_to(directory / "checkpoint-2").as_posix() for p in (directory / "checkpoint-2").rglob("*")
             if p.is_file()}
    agent_files = {"model.safetensors", "optimizer.safetensors", "config.json", "generation_config.json",
                   "tokenizer.json", "tokenizer_config.json"}  # a from_pretrained folder, plus its optimizer
    assert files == {"manifest.json", "trainer_state.json", "rng.safetensors",
                     *(f"agent-{i}/{name}" for i in range(2) for name in agent_files)}
    manifest = json.loads((directory / "checkpoint-2" / "manifest.json").read_text())
    assert set(manifest["files"]) == files - {"manifest.json"}  # every byte resume reads is hashed


def test_resume_equals_uninterrupted_bit_exact(uninterrupted, make_trainer, tmp_path):
    full, full_dir = uninterrupted
    part = make_trainer(num_train_epochs=2)
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = make_trainer(num_train_epochs=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"), checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(full_dir) == rows(tmp_path / "part")
    assert sorted(p.name for p in (tmp_path / "part").glob("checkpoint-*")) == [f"checkpoint-{i}" for i in range(1, 5)]


def test_resume_twice_in_a_row(uninterrupted, make_trainer, tmp_path):
    full, full_dir = uninterrupted
    d = tmp_path / "steps"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    make_trainer(num_train_epochs=3).train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)
    last = make_trainer(num_train_epochs=4)
    last.train(resume_from_checkpoint=d / "checkpoint-3", checkpoint_dir=d)
    assert_bit_exact(state_of(full), state_of(last))
    assert rows(full_dir) == rows(d)


def test_mid_epoch_resume_replaces_the_rows_written_after_the_checkpoint(uninterrupted, make_trainer, tmp_path):
    full, full_dir = uninterrupted
    d = tmp_path / "mid"
    # An "interrupted" run: a checkpoint after every optimizer step; pretend it died after step 6.
    make_trainer(num_train_epochs=4).train(checkpoint_dir=d, save_steps=1)
    assert len(rows(d)) == 16
    meta = read_checkpoint_metadata(d / "checkpoint-6")
    assert (meta["epoch"], meta["items_in_epoch"], meta["global_step"]) == (1, 2, 6)
    resumed = make_trainer(num_train_epochs=4)
    resumed.train(resume_from_checkpoint=d / "checkpoint-6", checkpoint_dir=d, save_steps=1)
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(full_dir) == rows(d)  # rows 7..16 were redone, not duplicated


def test_allowed_changes_on_resume(make_trainer, tmp_path):
    d = tmp_path / "allowed"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    resumed = make_trainer(num_train_epochs=2, logging_steps=2, output_dir=str(tmp_path / "elsewhere"),
                           agent_devices="cpu", eval_interval=3, eval_num_samples=2)
    resumed.train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d, checkpoint_interval=1,
                  checkpoint_total_limit=5)
    assert resumed.state.epoch == 2


def test_resuming_a_completed_run_does_nothing(make_trainer, tmp_path, caplog):
    d = tmp_path / "done"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=d)
    again = make_trainer(num_train_epochs=2)
    before = state_of(again)
    assert again.train(resume_from_checkpoint=d / "checkpoint-2", checkpoint_dir=d) == {}
    assert "nothing to train" in caplog.text
    assert again.state.global_step == 8  # loaded, not trained
    assert not all(torch.equal(before[k], v) for k, v in state_of(again).items() if torch.is_tensor(v) and k in before)


def _other_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(hidden_size=32))


@pytest.mark.parametrize("change, named", [
    (dict(agent_learning_rate=5e-4), "config.agent_learning_rate"),
    (dict(temperature=0.7), "config.temperature"),
    (dict(num_generations=2), "config.num_generations"),
    (dict(seed=1), "config.seed"),
    (dict(dataset=[{"prompt": p} for p in reversed(SEED_PROMPTS)]), "dataset"),
    (dict(reward_func=lambda a, b: [1.0] * len(a)), "reward_func"),
    (dict(num_agents=1, reward_func=lambda a: [1.0] * len(a)), "num_agents"),
])
def test_forbidden_changes_are_refused_by_name(make_trainer, tmp_path, change, named):
    d = tmp_path / "forbidden"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    other = make_trainer(num_train_epochs=2, **change)
    before = state_of(other)
    with pytest.raises(ResumeMismatchError, match=named.replace(".", r"\.")) as info:
        other.train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)
    assert "checkpoint-1" in str(info.value)
    assert_bit_exact(before, state_of(other))  # nothing was loaded into the refusing trainer


def test_changed_model_and_tokenizer_are_refused(make_trainer, model_path, tokenizer, tmp_path):
    d = tmp_path / "models"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    args = MAGRPOConfig(**dict(TEST_SETTINGS, num_train_epochs=2, max_new_tokens=12, agent_learning_rate=1e-3,
                               output_dir=str(tmp_path / "out")))
    dataset = [{"prompt": p} for p in SEED_PROMPTS]
    other_model = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path), _other_model()],
                                tokenizer=[tokenizer, tokenizer], reward_func=length_ratio_reward,
                                train_dataset=dataset, args=args)
    with pytest.raises(ResumeMismatchError, match=r"models\[1\]"):
        other_model.train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)
    other_tok = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                              tokenizer=build_tiny_tokenizer(vocab_size=400), reward_func=length_ratio_reward,
                              train_dataset=dataset, args=args)
    with pytest.raises(ResumeMismatchError, match=r"tokenizers\[0\]"):
        other_tok.train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)


@pytest.fixture
def saved(make_trainer, tmp_path):
    d = tmp_path / "saved"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    return d / "checkpoint-1"


def _resume(make_trainer, path):
    make_trainer(num_train_epochs=2).train(resume_from_checkpoint=path)


def test_missing_checkpoint_is_named(make_trainer, tmp_path):
    with pytest.raises(CheckpointError, match="nope.*does not exist"):
        _resume(make_trainer, tmp_path / "nope")


def test_truncated_weights_are_refused(make_trainer, saved):
    f = saved / "agent-1" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="agent-1/model.safetensors has 1000 bytes"):
        _resume(make_trainer, saved)
    assert find_latest_checkpoint(saved.parent) is None


@pytest.mark.parametrize("damage, words", [
    (lambda c: (c / "agent-0" / "optimizer.safetensors").unlink(), "agent-0/optimizer.safetensors is missing"),
    (lambda c: (c / "trainer_state.json").write_text('{"counters": '),
     "trainer_state.json has 13 bytes"),
    (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
])
def test_missing_state_or_file_is_refused(make_trainer, saved, damage, words):
    damage(saved)
    with pytest.raises(CheckpointError, match=words):
        _resume(make_trainer, saved)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _forge_manifest(checkpoint: Path, change) -> None:
    """Rewrite a checkpoint's manifest with its own hash recomputed, as a deliberate forger would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    change(body)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps({**body, "sha256": digest}))


def test_tampered_checkpoint_never_runs_code(make_trainer, saved, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(str(marker)))
    (saved / "agent-0" / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError, match="sha256|bytes"):
        _resume(make_trainer, saved)
    # Even with the manifest forged to match, the pickle is parsed as safetensors, never unpickled.
    entry = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    _forge_manifest(saved, lambda body: body["files"].update({"agent-0/model.safetensors": entry}))
    with pytest.raises(CheckpointError, match="could not be loaded"):
        _resume(make_trainer, saved)
    _forge_manifest(saved, lambda body: body["files"].update({"../../escape": {"bytes": 1, "sha256": "0"}}))
    with pytest.raises(CheckpointError, match="unexpected|outside the checkpoint"):
        _resume(make_trainer, saved)
    assert not marker.exists()


def test_retention_keeps_the_newest(make_trainer, tmp_path):
    d = tmp_path / "limited"
    make_trainer(num_train_epochs=4).train(checkpoint_dir=d, checkpoint_total_limit=2)
    assert sorted(p.name for p in d.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not list(d.glob(".*checkpoint*"))


def test_fresh_run_refuses_a_directory_with_another_runs_checkpoints(make_trainer, tmp_path):
    d = tmp_path / "taken"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    snapshot = {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".comlrl.lock"}
    run_id = read_checkpoint_metadata(d / "checkpoint-1")["run_id"]
    with pytest.raises(CheckpointDirError, match=f"another run \\(run id {run_id[:12]};.*resume from its newest"):
        make_trainer(num_train_epochs=2).train(checkpoint_dir=d)
    assert snapshot == {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".comlrl.lock"}


def test_leftover_temporary_directories_are_never_checkpoints(make_trainer, tmp_path):
    d = tmp_path / "crashy"
    (d / ".tmp-checkpoint-1-deadbeef" / "agent-0").mkdir(parents=True)
    assert find_latest_checkpoint(d) is None
    make_trainer(num_train_epochs=1).train(checkpoint_dir=d)
    assert [p.name for p in d.iterdir() if "checkpoint" in p.name] == ["checkpoint-1"]


def test_bad_train_arguments(make_trainer, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint_interval"):
        make_trainer().train(checkpoint_dir=tmp_path, checkpoint_interval=0)
    with pytest.raises(ConfigError, match="need a checkpoint_dir"):
        make_trainer().train(save_steps=3)
    with pytest.raises(ConfigError, match="generation keyword"):
        make_trainer().train(do_sample=False)


def test_resuming_an_older_checkpoint_removes_the_newer_ones_of_the_run(make_trainer, tmp_path):
    d = tmp_path / "rewind"
    make_trainer(num_train_epochs=4).train(checkpoint_dir=d)
    # Rewind to checkpoint-2 with a limit of 1: the stale checkpoint-3/4 must not outlive the new saves.
    resumed = make_trainer(num_train_epochs=3)
    resumed.train(resume_from_checkpoint=d / "checkpoint-2", checkpoint_dir=d, checkpoint_total_limit=1)
    assert [p.name for p in d.glob("checkpoint-*")] == ["checkpoint-3"]
    assert read_checkpoint_metadata(d / "checkpoint-3")["epoch"] == 3
    assert [r["env_step"] for r in rows(d)] == [4 * i for i in range(1, 13)]


def test_function_fingerprints_are_stable_across_processes(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "fp.py"
    script.write_text(
        "import functools\n"
        "from comlrl.checkpoint.fingerprint import callable_fingerprint\n"
        "def reward(a, b, scale=1):\n    return [scale] * len(a)\n"
        "class Reward:\n    def __init__(self):\n        self.scale = 2\n"
        "    def __call__(self, a, b):\n        return [self.scale] * len(a)\n"
        "print(callable_fingerprint(functools.partial(reward, scale=3)), callable_fingerprint(Reward()))\n")
    # This process and another, each with its own string-hash seed, print the same fingerprints.
    import contextlib
    import io
    import os
    import runpy

    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    other = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        runpy.run_path(str(script), run_name="__main__")
    assert here.getvalue() == other and "partial(" in other


def test_values_read_inside_comprehensions_are_part_of_a_reward(tmp_path):
    """A module value a reward reads only inside a comprehension or lambda is fingerprinted too;
    the same function in another module is another reward (its helpers may differ)."""
    import importlib.util

    from comlrl.checkpoint.fingerprint import callable_fingerprint, compare_fingerprints

    def load(name, source):
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return callable_fingerprint(module.reward)

    body = "SCALE = 2\ndef reward(a, b):\n    return [SCALE * len(x) for x in a]\n"
    base = load("rewards_a", body)
    assert load("rewards_b", body.replace("rewards_a", "x")) != base  # another module
    assert compare_fingerprints({"r": base}, {"r": load("rewards_a2", body.replace("SCALE = 2", "SCALE = 3"))})
    lam = "SCALE = 2\nreward = lambda a, b: [SCALE * len(x) for x in a]\n"
    assert load("lam_a", lam).split(":")[1] != load("lam_b", lam.replace("SCALE = 2", "SCALE = 3")).split(":")[1]


def test_a_snapshot_reuses_the_previous_buffers_and_holds_a_copy(make_trainer):
    """The next save writes into the last snapshot's buffers (no fresh allocation), and a snapshot
    is a copy: training after it does not change it."""
    from comlrl.checkpoint import files

    trainer = make_trainer(num_train_epochs=1)
    trainer.train()
    slots = trainer.trained_slots()
    first = files.snapshot(1, {"run_id": "x"}, slots.modules, slots.optimizers, {})
    weights = first.files["agent-0/model.safetensors"][0]
    name = next(iter(weights))
    pointer, before = weights[name].data_ptr(), weights[name].clone()
    with torch.no_grad():
        for p in trainer.agents[0].parameters():
            p.add_(1.0)
    assert torch.equal(weights[name], before)
    second = files.snapshot(2, {"run_id": "x"}, slots.modules, slots.optimizers, {}, reuse=first)
    reused = second.files["agent-0/model.safetensors"][0][name]
    assert reused.data_ptr() == pointer and torch.equal(reused, before + 1.0)


def test_save_and_load_checkpoint_methods(make_trainer, tmp_path):
    """CoMLRL's save_checkpoint(dir) / load_checkpoint(dir): a manual save between train() calls
    restores into a fresh trainer, whose next train() continues exactly."""
    full = make_trainer(num_train_epochs=2)
    full.train()
    first = make_trainer(num_train_epochs=1)
    first.train()
    path = first.save_checkpoint(tmp_path / "manual")
    assert Path(path).name == "manual" and read_checkpoint_metadata(path)["epoch"] == 1
    second = make_trainer(num_train_epochs=2)
    assert second.load_checkpoint(path)["epoch"] == 1
    second.train()
    assert_bit_exact(state_of(full), state_of(second))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        (tmp_path / "occupied").mkdir()
        (tmp_path / "occupied" / "notes.txt").write_text("mine")
        first.save_checkpoint(tmp_path / "occupied")
