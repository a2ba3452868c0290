"""What resume trusts, checked even when every hash was recomputed (as anyone can): scheduler and
optimizer hyper-parameters against the config, moments against their parameters, at load; a
malformed checkpoint of any kind skipped by name, never a crash; the dataset fingerprint taken
before user code sees (and annotates) a row; numpy scalars read by a reward fingerprinted by value."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comlrl import CheckpointError, ResumeMismatchError
from comlrl.checkpoint import files
from comlrl.cli import main
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

from helpers import length_ratio_reward, state_of
from test_checkpoint_safety import forge


@pytest.fixture
def run(make_trainer, tmp_path):
    d = tmp_path / "run"
    make_trainer(num_train_epochs=2, warmup_steps=3).train(checkpoint_dir=d)
    return d


def forge_tensors(checkpoint, rel, edit):
    """Edit a tensor file of a checkpoint and re-hash it in the manifest."""
    from safetensors import safe_open

    tensors = load_file(str(checkpoint / rel))
    with safe_open(str(checkpoint / rel), "pt") as handle:
        metadata = handle.metadata()  # tied weights' aliases: a forger keeps them
    edit(tensors)
    save_file(tensors, str(checkpoint / rel), metadata=metadata)
    raw = (checkpoint / rel).read_bytes()

    def listed(body):
        body["files"][rel] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    forge(checkpoint, edit_manifest=listed)


def _refused_at_load(make_trainer, checkpoint, words):
    """load_checkpoint (no training step) refuses, and the trainer's state is untouched."""
    trainer = make_trainer(num_train_epochs=3, warmup_steps=3)
    before = state_of(trainer)
    with pytest.raises(CheckpointError, match=words):
        trainer.load_checkpoint(checkpoint)
    assert all(torch.equal(before[k], v) if torch.is_tensor(v) else before[k] == v
               for k, v in state_of(trainer).items())
    assert trainer.schedulers[0].base_lrs == [1e-3] and trainer.optimizers[0].param_groups[0]["lr"] < 1e-3


# --- 8. forged hyper-state --------------------------------------------------------------------------

def _set_lr(state, value):
    state["schedulers"]["agent-0"]["base_lrs"] = [value]
    state["schedulers"]["agent-0"]["_last_lr"] = [value]
    state["optimizers"]["agent-0"]["param_groups"][0].update(lr=value, initial_lr=value)


@pytest.mark.parametrize("edit, words", [
    (lambda s: _set_lr(s, 1000.0), "schedulers\\['agent-0'\\].base_lrs is \\[1000.0\\], while this run's config "
                                   "gives \\[0.001\\]"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(lr=1000.0),
     "param_groups\\[0\\].lr is 1000.0, while the schedule gives"),
    (lambda s: s["schedulers"]["agent-0"].update(_last_lr=[1000.0]), "._last_lr is \\[1000.0\\], not the schedule's"),
    (lambda s: s["schedulers"]["agent-0"].update(last_epoch=-3), ".last_epoch must be a non-negative int"),
    (lambda s: s["schedulers"]["agent-0"].update(last_epoch=True), ".last_epoch must be a non-negative int"),
    (lambda s: s["schedulers"]["agent-0"].update(optimizer={}), "not this schedule's fields"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(decoupled_weight_decay=False),
     "decoupled_weight_decay is False, while this run's config gives True"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(eps=0.5), "param_groups\\[0\\].eps is 0.5"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(momentum=0.9), "unknown key\\(s\\) \\['momentum'\\]"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(params=[0]), ".params does not list"),
    (lambda s: s["optimizers"]["agent-0"]["scalars"].update({"0": {"step": 1e9}}), "state\\[0\\].step must be"),
])
def test_forged_hyper_state_is_refused_at_load(make_trainer, run, edit, words):
    forge(run / "checkpoint-2", edit)
    _refused_at_load(make_trainer, run / "checkpoint-2", words)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.update({"0.exp_avg": t["0.exp_avg"].reshape(-1)}), "state\\[0\\].exp_avg is a torch.float32 tensor of "
                                                                    "shape \\[32768\\], while its parameter is"),
    (lambda t: t.update({"0.exp_avg": t["0.exp_avg"].double()}), "state\\[0\\].exp_avg is a torch.float64 tensor"),
    (lambda t: t.update({"1.exp_avg_sq": -t["1.exp_avg_sq"] - 1}), "state\\[1\\].exp_avg_sq holds negative values"),
    (lambda t: t.update({"1.exp_avg": t["1.exp_avg"] * float("nan")}), "state\\[1\\].exp_avg holds non-finite"),
    (lambda t: t.update({"2.step": torch.tensor(1e6)}), "state\\[2\\].step must be a whole number of steps no larger "
                                                       "than the schedule's 8 steps"),
    (lambda t: t.pop("3.exp_avg_sq"), "state\\[3\\] holds \\['exp_avg', 'step'\\]"),
    (lambda t: t.update({"9999.exp_avg": torch.zeros(2)}), "entries for parameters this optimizer does not have"),
])
def test_forged_moments_are_refused_at_load_not_a_step_later(make_trainer, run, edit, words):
    forge_tensors(run / "checkpoint-2", "agent-0/optimizer.safetensors", edit)
    _refused_at_load(make_trainer, run / "checkpoint-2", words)


def test_non_finite_weights_are_refused(make_trainer, run):
    forge_tensors(run / "checkpoint-2", "agent-1/model.safetensors",
                  lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"] * float("inf")}))
    with pytest.raises(CheckpointError, match="agent-1 weight .* holds non-finite values"):
        make_trainer(num_train_epochs=3, warmup_steps=3).load_checkpoint(run / "checkpoint-2")


def test_an_honest_checkpoint_still_resumes(make_trainer, run, tmp_path):
    full = make_trainer(num_train_epochs=3, warmup_steps=3)
    full.train(checkpoint_dir=tmp_path / "full")
    resumed = make_trainer(num_train_epochs=3, warmup_steps=3)
    resumed.train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    from helpers import assert_bit_exact

    assert_bit_exact(state_of(full), state_of(resumed))


# --- malformed in any way: skipped by name, never a crash ------------------------------------------------

def _deep(levels):
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("raw, words", [
    (lambda: _deep(200_000).encode(), "nests deeper than 64 levels"),
    (lambda: json.dumps({"a": json.loads(_deep(100))}).encode(), "nests deeper than 64 levels"),
    (lambda: b'{"run_id": NaN}', "NaN is not JSON"),
])
def test_a_malformed_state_is_skipped_by_name(make_trainer, run, capsys, caplog, raw, words):
    body = raw()

    def replace_state(manifest):
        manifest["files"][files.STATE_FILE] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    forge(run / "checkpoint-2", edit_manifest=replace_state)
    (run / "checkpoint-2" / files.STATE_FILE).write_bytes(body)
    assert find_latest_checkpoint(run) == run / "checkpoint-1"
    assert "skipping" in caplog.text and "checkpoint-2" in caplog.text and words.split()[0] in caplog.text
    with pytest.raises(CheckpointError, match=words):
        read_checkpoint_metadata(run / "checkpoint-2")
    assert main(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out
    assert "NOT VERIFIED" in out and "--resume auto continues from checkpoint-1" in out


def test_a_symlinked_checkpoint_is_skipped_everywhere(run, capsys, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoint-2").rename(elsewhere)
    (run / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    assert find_latest_checkpoint(run) == run / "checkpoint-1"
    assert main(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out
    assert "a symbolic link to" in out and "--resume auto skips it" in out
    assert "--resume auto continues from checkpoint-1" in out


# --- 7. a reward that annotates its rows ---------------------------------------------------------------

def annotating_reward(completions1, completions2, batch_items=None):
    for item in batch_items:  # a memo field on the row, as rewards do
        item["scored"] = item.get("scored", 0) + 1
        item.setdefault("cache", {})[completions1[0]] = 1.0
    return length_ratio_reward(completions1, completions2)


def annotating_formatter(item):
    item["formatted"] = True
    return item["prompt"]


def test_a_reward_that_annotates_its_rows_still_resumes(make_trainer, tmp_path):
    from helpers import SEED_PROMPTS

    dataset = [{"prompt": p} for p in SEED_PROMPTS]
    kwargs = {"formatters": annotating_formatter}
    make_trainer(num_train_epochs=1, reward_func=annotating_reward, dataset=dataset,
                 trainer_kwargs=kwargs).train(checkpoint_dir=tmp_path / "run")
    assert dataset == [{"prompt": p} for p in SEED_PROMPTS]  # the user's rows are never changed
    make_trainer(num_train_epochs=2, reward_func=annotating_reward, dataset=[{"prompt": p} for p in SEED_PROMPTS],
                 trainer_kwargs=kwargs).train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1",
                                              checkpoint_dir=tmp_path / "run")
    assert read_checkpoint_metadata(tmp_path / "run" / "checkpoint-2")["epoch"] == 2


# --- numpy scalars are fingerprinted by value -------------------------------------------------------------

def test_a_changed_numpy_threshold_is_a_changed_reward(make_trainer, tmp_path):
    def reward_with(threshold):
        def reward(completions1, completions2):
            return [float(len(b) > threshold * len(a)) for a, b in zip(completions1, completions2)]
        return reward

    make_trainer(num_train_epochs=1, reward_func=reward_with(np.float32(2.0))).train(checkpoint_dir=tmp_path / "r")
    with pytest.raises(ResumeMismatchError, match="reward_func"):
        make_trainer(num_train_epochs=2, reward_func=reward_with(np.float32(3.0))).train(
            resume_from_checkpoint=tmp_path / "r" / "checkpoint-1", checkpoint_dir=tmp_path / "r")
    make_trainer(num_train_epochs=2, reward_func=reward_with(np.float32(2.0))).train(
        resume_from_checkpoint=tmp_path / "r" / "checkpoint-1", checkpoint_dir=tmp_path / "r")


# --- YAML: aliases expand within bounds ---------------------------------------------------------------

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]"] +
                 [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)] +
                 ["trainer: {name: MAGRPO, args: {seed: 1}}", "bomb: *i"])


def test_an_anchor_bomb_is_refused_clearly(tmp_path, capsys):
    from comlrl.cli.yamlconf import CliError, load_document, parse_value

    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)  # 10^9 values once expanded, in 10 lines
    with pytest.raises(CliError, match="expands to more than 1,000,000 values through its aliases"):
        load_document(config)
    assert main(["train", str(config)]) == 2
    assert "anchor bomb" in capsys.readouterr().err
    config.write_text("trainer: &t {name: MAGRPO, args: {seed: 1, again: *t}}")
    with pytest.raises(CliError, match="recursive anchor"):
        load_document(config)
    config.write_text("trainer: {name: MAGRPO}\nshared: &s {lr: 0.1}\nuses: [*s, *s]")
    assert load_document(config).data["uses"] == [{"lr": 0.1}, {"lr": 0.1}]  # ordinary aliases still work
    assert parse_value("&a [1, 2]") == [1, 2]
    with pytest.raises(CliError, match="a flag's value: the YAML expands"):  # --key '{...bomb...}'
        parse_value("{" + BOMB.replace("\n", ", ") + "}")
