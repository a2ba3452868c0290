"""A tracker that fails at an epoch's end (TensorBoard on a full disk, MLflow answering 503) never
costs that epoch's checkpoint: the checkpoint is written first, then tracker_failure decides:
'raise' stops with TrackerError (resuming continues exactly), 'disable' trains on without it."""

import errno
import os

import pytest

from comlrl import ConfigError, TrackerError, TrainingError
from comlrl.tracking import tensorboard
from comlrl.utils import find_latest_checkpoint

from helpers import assert_bit_exact, rows, state_of

pytest.importorskip("tensorboard")
TRACKED = dict(report_to=["jsonl", "tensorboard"])


def full_disk_at(failing):
    """A TensorBoardTracker.log that fails with ENOSPC at env_step ``failing``."""
    real = tensorboard.TensorBoardTracker.log

    def log(self, row, step):
        if step == failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, row, step)
    return log


def test_the_checkpoint_comes_first_then_the_failure_is_raised(make_trainer, tmp_path, monkeypatch):
    full = make_trainer(num_train_epochs=3, **TRACKED)
    full.train(checkpoint_dir=tmp_path / "full")
    run = tmp_path / "run"
    monkeypatch.setattr(tensorboard.TensorBoardTracker, "log", full_disk_at(32))  # epoch 2's last row
    with pytest.raises(TrackerError, match="tracker 'tensorboard' failed logging the row at env_step 32: OSError: "
                                           ".*No space left on device. Training stopped; checkpoint-2 was written "
                                           "first") as caught:
        make_trainer(num_train_epochs=3, **TRACKED).train(checkpoint_dir=run)
    assert isinstance(caught.value, TrainingError) and isinstance(caught.value.__cause__, OSError)
    assert find_latest_checkpoint(run) == run / "checkpoint-2"  # the epoch whose row failed is saved
    assert [r["env_step"] for r in rows(run)][-1] == 32  # the other trackers hold the row
    monkeypatch.undo()  # the disk has space again
    resumed = make_trainer(num_train_epochs=3, **TRACKED)
    resumed.train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(run) == rows(tmp_path / "full")


def test_a_failed_sync_before_a_checkpoint_does_not_cost_it(make_trainer, tmp_path, monkeypatch):
    def broken_sync(self):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tensorboard.TensorBoardTracker, "sync", broken_sync)
    with pytest.raises(TrackerError, match="failed syncing before a checkpoint.*checkpoint-1 was written first"):
        make_trainer(num_train_epochs=2, **TRACKED).train(checkpoint_dir=tmp_path / "run")
    assert find_latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoint-1"


def test_disable_trains_on_without_the_failed_tracker(make_trainer, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tensorboard.TensorBoardTracker, "log", full_disk_at(16))
    trainer = make_trainer(num_train_epochs=3, tracker_failure="disable", **TRACKED)
    trainer.train(checkpoint_dir=tmp_path / "run")
    assert find_latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoint-3"
    assert [r["env_step"] for r in rows(tmp_path / "run")] == [4 * i for i in range(1, 13)]
    assert "tracker tensorboard failed logging the row at env_step 16" in caplog.text
    assert "training goes on without it" in caplog.text


def test_the_policy_is_checked_when_built_and_may_change_on_resume(make_trainer, tmp_path):
    from comlrl import MAGRPOConfig

    with pytest.raises(ConfigError, match="tracker_failure must be one of 'raise', 'disable'"):
        MAGRPOConfig(tracker_failure="explode")
    assert MAGRPOConfig(tracker_failure="warn").tracker_failure == "disable"
    make_trainer(num_train_epochs=1).train(checkpoint_dir=tmp_path / "run")
    make_trainer(num_train_epochs=2, tracker_failure="disable").train(
        resume_from_checkpoint=tmp_path / "run" / "checkpoint-1", checkpoint_dir=tmp_path / "run")
