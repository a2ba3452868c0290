"""What a resume deserializes is what it verified, and counters that do not fit are refused
(issue 29 items 3 and 4): a file replaced between the hash check and the load, forged counters
with a recomputed manifest, and a training loop that could not advance."""

import hashlib
import json
import shutil
import signal

import pytest
from safetensors.torch import load_file, save_file

from comlrl import CheckpointError, TrainingError
from comlrl.checkpoint import files, manager

from helpers import state_of


@pytest.fixture
def two_checkpoints(make_trainer, tmp_path):
    directory = tmp_path / "run"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=directory)
    return directory / "checkpoint-1", directory / "checkpoint-2"


@pytest.mark.parametrize("rel", ["agent-0/model.safetensors", "agent-1/optimizer.safetensors", "rng.safetensors"])
def test_a_file_replaced_after_verification_is_never_loaded(two_checkpoints, make_trainer, monkeypatch, rel):
    first, second = two_checkpoints
    real_verify = files.verify

    def verify_then_swap(path, expected=None):  # the race: the file changes once its hash has been checked
        manifest = real_verify(path, expected)
        if path == second:
            _replace(first / rel, second / rel)
        return manifest
    monkeypatch.setattr(manager.files, "verify", verify_then_swap)
    trainer = make_trainer(num_train_epochs=2)
    before = state_of(trainer)
    with pytest.raises(CheckpointError, match=f"{rel.split('/')[-1]}.*sha256"):
        trainer.load_checkpoint(second)
    if rel != "rng.safetensors":  # nothing of a refused checkpoint reached the live optimizer or weights
        after = state_of(trainer)
        assert all((before[k] == after[k]).all() if hasattr(before[k], "all") else before[k] == after[k]
                   for k in before)


def _replace(source, target):
    """Write another checkpoint's file over ``target`` in place (as ``cp`` does); where the two
    are equal (the random states of consecutive epochs may be), a changed copy of it."""
    if source.read_bytes() != target.read_bytes():
        shutil.copyfile(source, target)
        return
    tensors = load_file(str(source))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(target))


def _forge(checkpoint, change):
    """Edit trainer_state.json and recompute the manifest, as anyone can."""
    state = json.loads((checkpoint / files.STATE_FILE).read_text())
    change(state)
    raw = json.dumps(state).encode()
    (checkpoint / files.STATE_FILE).write_bytes(raw)
    manifest = json.loads((checkpoint / files.MANIFEST_FILE).read_text())
    manifest["files"][files.STATE_FILE] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    manifest["sha256"] = hashlib.sha256(files._canonical(body)).hexdigest()
    (checkpoint / files.MANIFEST_FILE).write_text(json.dumps(manifest))


def _set(name, value):
    return lambda state: state["counters"].__setitem__(name, value)


@pytest.mark.parametrize("change, message", [
    (_set("global_step", 10**9), "global_step is 1000000000"),
    (_set("env_step", 10**3000), "below 2\\*\\*63"),
    (_set("global_step", 2**63), "below 2\\*\\*63"),
])
def test_forged_counters_are_refused(two_checkpoints, make_trainer, change, message):
    _, second = two_checkpoints
    _forge(second, change)
    with pytest.raises(CheckpointError, match=message):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=str(second), checkpoint_dir=second.parent)


@pytest.fixture
def deadline():
    """A spinning loop fails the test (SIGALRM) instead of hanging the suite."""
    def expire(*_):
        raise TimeoutError("train() spun without progress")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("items", [8, 10**6])
def test_items_in_epoch_past_the_dataset_stops_instead_of_spinning(two_checkpoints, make_trainer, deadline, items):
    _, second = two_checkpoints
    _forge(second, _set("items_in_epoch", items))  # the seed's dataset has 8 prompts
    with pytest.raises(TrainingError, match=f"items_in_epoch is {items}"):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=str(second), checkpoint_dir=second.parent)
