"""What a run writes in its directory, and what it never touches: no write through a symbolic link
(the lock, metrics.jsonl, tracker folders), no checkpoint-N folder of others replaced or deleted,
no metrics file of another run emptied, a lock released when writing it fails."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from comlrl import CheckpointDirError, CheckpointError, ConfigError
from comlrl.checkpoint import files
from comlrl.checkpoint.lock import LOCK_FILE, DirectoryLock
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

from helpers import SEED_PROMPTS, length_ratio_reward, rows

FIXTURE = Path(__file__).parent / "fixtures" / "comlrl143"


def everything(directory: Path) -> dict:
    """Every file below ``directory`` (links as their target's name) with its bytes."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            out[path] = ("link", os.readlink(path))
        elif path.is_file() and path.name != LOCK_FILE:
            out[path] = path.read_bytes()
    return out


@pytest.fixture
def victim(tmp_path):
    """A file of the user's that a planted link points at (writable by whoever runs the tests:
    root could write any file, a user only their own, so both are meaningful)."""
    target = tmp_path / "precious.txt"
    target.write_text("the user's own data\n")
    return target


# --- 1. never through a link -----------------------------------------------------------------------

def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(make_trainer, tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    with pytest.raises(CheckpointDirError, match="lock file .* is a symbolic link"):
        make_trainer(num_train_epochs=1).train(checkpoint_dir=run)
    assert victim.read_text() == "the user's own data\n"
    assert not list(run.glob("checkpoint-*"))
    (run / LOCK_FILE).unlink()
    (run / LOCK_FILE).symlink_to(tmp_path / "does-not-exist")  # a dangling link would be created through
    with pytest.raises(CheckpointDirError, match="symbolic link"):
        DirectoryLock(run)
    assert not (tmp_path / "does-not-exist").exists()


def test_a_lock_file_with_a_second_name_is_refused(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    os.link(victim, run / LOCK_FILE)
    with pytest.raises(CheckpointDirError, match="hard link"):
        DirectoryLock(run)
    assert victim.read_text() == "the user's own data\n"


def test_a_metrics_file_that_is_a_link_is_refused(make_trainer, tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(CheckpointDirError, match="metrics file .* is a symbolic link"):
        make_trainer(num_train_epochs=1).train(checkpoint_dir=run)
    assert victim.read_text() == "the user's own data\n"
    assert (run / "metrics.jsonl").is_symlink()  # not renamed away either


def test_a_tensorboard_folder_that_is_a_link_is_refused(make_trainer, tmp_path):
    pytest.importorskip("tensorboard")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointDirError, match="TensorBoard root .* is a symbolic link"):
        make_trainer(num_train_epochs=1, report_to=["jsonl", "tensorboard"]).train(checkpoint_dir=run)
    assert not list(elsewhere.iterdir())


# --- disk full while taking the lock ------------------------------------------------------------------

def test_a_full_disk_while_taking_the_lock_releases_it(make_trainer, tmp_path, monkeypatch):
    from comlrl.checkpoint import lock

    run = tmp_path / "run"

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock.os, "write", full)
    with pytest.raises(CheckpointDirError, match="could not write the lock file .*No space left on device. Free space"):
        make_trainer(num_train_epochs=1).train(checkpoint_dir=run)
    monkeypatch.undo()
    # Space again: the next train() in the same process is not told that "another run" holds it.
    trainer = make_trainer(num_train_epochs=1)
    trainer.train(checkpoint_dir=run)
    assert find_latest_checkpoint(run) == run / "checkpoint-1"


# --- 2. checkpoint-N folders the run did not write -------------------------------------------------

def _hf_checkpoint(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 500, "log_history": []}))
    (path / "optimizer.pt").write_bytes(b"\x80\x02}q\x00.")
    (path / "model.safetensors").write_bytes(b"weights")


def _lost_manifest(path: Path, make_trainer) -> None:
    make_trainer(num_train_epochs=1).train(checkpoint_dir=path.parent / "elsewhere")
    shutil.copytree(path.parent / "elsewhere" / "checkpoint-1", path)
    (path / files.MANIFEST_FILE).unlink()


@pytest.mark.parametrize("plant, words", [
    (lambda p, mk: _hf_checkpoint(p), "written by the Hugging Face Trainer \\(model.safetensors, optimizer.pt\\)"),
    (lambda p, mk: shutil.copytree(FIXTURE / "run" / "checkpoint-2", p), "written by CoMLRL 1.4.3"),
    (_lost_manifest, "a comlrl checkpoint whose manifest.json is missing"),
    (lambda p, mk: (p.mkdir(), (p / "notes.md").write_text("mine")), "not a comlrl checkpoint .*notes.md"),
    (lambda p, mk: p.write_text("a file"), "a file"),
    (lambda p, mk: p.symlink_to(p.parent / "somewhere"), "a symbolic link"),
])
def test_a_fresh_run_refuses_checkpoint_folders_it_did_not_write(make_trainer, tmp_path, plant, words):
    run = tmp_path / "run"
    run.mkdir()
    plant(run / "checkpoint-1", make_trainer)
    before = everything(run)
    with pytest.raises(CheckpointDirError, match=f"holds checkpoint-1, {words}.*nothing was touched"):
        make_trainer(num_train_epochs=2).train(checkpoint_dir=run)
    assert everything(run) == before


def test_a_comlrl143_checkpoint_resumes_in_its_directory_and_is_never_replaced(tmp_path):
    """Resuming a 1.4.3 checkpoint where it lies is allowed (it stays untouched); a 1.4.3 folder
    the resumed run would write over later is refused up front."""
    from test_legacy_resume import build

    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-1")
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    before = everything(run)
    with pytest.raises(CheckpointDirError, match="holds checkpoint-3, written by CoMLRL 1.4.3.*resuming from "
                                                 "checkpoint-2 would later write a checkpoint-3"):
        build().train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert everything(run) == before
    shutil.rmtree(run / "checkpoint-3")
    build().train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert (run / "checkpoint-3" / files.MANIFEST_FILE).is_file()
    for old in ("checkpoint-1", "checkpoint-2"):
        assert {p: b for p, b in everything(run).items() if old in p.parts} == \
            {p: b for p, b in before.items() if old in p.parts}


def test_a_foreign_folder_in_the_way_of_a_save_is_never_replaced(make_trainer, tmp_path):
    """Planted while the run holds the directory: the save refuses instead of swapping it out."""
    run = tmp_path / "run"
    trainer = make_trainer(num_train_epochs=2)
    real_save = trainer.save_run_checkpoint

    def plant_then_save(number, limit):
        if number == 2:
            _hf_checkpoint(run / "checkpoint-2")
        return real_save(number, limit)

    trainer.save_run_checkpoint = plant_then_save
    with pytest.raises(CheckpointDirError, match="checkpoint-2 exists and is not a checkpoint"):
        trainer.train(checkpoint_dir=run)
    assert (run / "checkpoint-2" / "optimizer.pt").read_bytes() == b"\x80\x02}q\x00."


def test_save_checkpoint_replaces_only_its_own_run(make_trainer, tmp_path):
    first, other = make_trainer(num_train_epochs=1), make_trainer(num_train_epochs=1)
    path = first.save_checkpoint(tmp_path / "manual")
    first.save_checkpoint(tmp_path / "manual")  # its own: replaced
    before = everything(Path(path))
    with pytest.raises(CheckpointError, match="another run's"):
        other.save_checkpoint(tmp_path / "manual")
    assert everything(Path(path)) == before


# --- 3. a metrics file of another run ---------------------------------------------------------------

def test_resuming_into_a_shared_output_dir_keeps_the_other_runs_metrics(make_trainer, tmp_path):
    shared = tmp_path / "out"  # the default output_dir of both runs: no checkpoint_dir for the second
    make_trainer(num_train_epochs=1, output_dir=str(shared)).train()
    earlier = (shared / "metrics.jsonl").read_bytes()
    assert earlier
    make_trainer(num_train_epochs=1).train(checkpoint_dir=tmp_path / "a")
    resumed = make_trainer(num_train_epochs=2, output_dir=str(shared))
    resumed.train(resume_from_checkpoint=tmp_path / "a" / "checkpoint-1")
    kept = [p for p in shared.glob("metrics.*.jsonl")]
    assert len(kept) == 1 and kept[0].read_bytes() == earlier  # set aside whole, as a fresh run does
    assert [r["env_step"] for r in rows(shared)] == [20, 24, 28, 32]  # only the resumed run's rows after it


def test_resuming_in_place_still_drops_only_its_own_redone_rows(make_trainer, tmp_path):
    run = tmp_path / "run"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=run)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"env_step": 3')  # a row cut short by a crash: the run's own
    make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-1", checkpoint_dir=run)
    assert not list(run.glob("metrics.*.jsonl"))
    assert [r["env_step"] for r in rows(run)] == [4 * i for i in range(1, 13)]
    assert read_checkpoint_metadata(run / "checkpoint-3")["env_step"] == 48


# --- exports: nothing replaced that export did not write -------------------------------------------

def test_save_model_never_replaces_what_it_did_not_write(make_trainer, tmp_path, monkeypatch):
    trainer = make_trainer(num_train_epochs=1)
    out = tmp_path / "out"
    (out / "agent_0").mkdir(parents=True)
    (out / "agent_0" / "my_notes.txt").write_text("the user's own agent_0")
    # refused at its top-level entry: a folder of the user's is never walked (issue 29)
    with pytest.raises(ConfigError, match="already holds files export did not write \\(agent_0\\)"):
        trainer.save_model(out)
    assert (out / "agent_0" / "my_notes.txt").read_text() == "the user's own agent_0"
    # `comlrl export CK .`: an empty working directory is written into, never renamed or removed.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    trainer.save_model(".")
    trainer.save_model(".")  # its own earlier export: replaced folder by folder
    assert sorted(p.name for p in here.iterdir()) == [".comlrl-export.json", "agent_0", "agent_1"]
    (here / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match="mine.txt"):
        trainer.save_model(".")
    assert (here / "agent_0" / "config.json").is_file() and (here / "mine.txt").read_text() == "mine"
    (tmp_path / "link").symlink_to(here, target_is_directory=True)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        trainer.save_model(tmp_path / "link")


# --- 6. policy snapshots of the history comparator are the run's own -----------------------------------

def _history_run(model_path, tokenizer, tmp_path, seed=0, **settings):
    from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer

    args = dict(num_train_epochs=1, num_iterations=3, preference_num_candidates=2, preference_pairs_per_sample=2,
                max_new_tokens=6, temperature=1.0, top_p=1.0, train_batch_size=2, eval_interval=0, logging_steps=1,
                comparator_policy="history", comparator_history_k=1, seed=seed, agent_learning_rate=1e-3,
                output_dir=str(tmp_path / f"out-{seed}"), policy_checkpoint_dir=str(tmp_path / "shared-snapshots"))
    args.update(settings)
    return MADPOIterTrainer(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:2]], args=MADPOIterConfig(**args))


def test_history_snapshots_are_bound_to_their_run(model_path, tokenizer, tmp_path):
    from helpers import assert_bit_exact, state_of

    full = _history_run(model_path, tokenizer, tmp_path)
    full.train(checkpoint_dir=tmp_path / "full")
    first = _history_run(model_path, tokenizer, tmp_path, num_iterations=2)
    first.train(checkpoint_dir=tmp_path / "first")
    # A second run sharing the snapshot folder writes its own: the first run's are untouched.
    _history_run(model_path, tokenizer, tmp_path, seed=1).train(checkpoint_dir=tmp_path / "second")
    assert len(list((tmp_path / "shared-snapshots").iterdir())) == 3  # full, first, second: a folder each
    resumed = _history_run(model_path, tokenizer, tmp_path)
    latest = find_latest_checkpoint(tmp_path / "first")
    resumed.train(resume_from_checkpoint=latest, checkpoint_dir=tmp_path / "first")
    assert_bit_exact(state_of(full), state_of(resumed))
    # A changed snapshot, or another run's put in its place, is refused by name.
    mine = tmp_path / "shared-snapshots" / f"run-{first.run_id[:8]}" / "iteration_0001"
    weights = mine / "agent_0" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="iteration_0001 is not the one this run saved .*agent_0/model.safetensors"):
        _history_run(model_path, tokenizer, tmp_path).train(
            resume_from_checkpoint=latest, checkpoint_dir=tmp_path / "again")
