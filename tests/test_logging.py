import json

import pytest

from comlrl import ConfigError
from comlrl.logging import JsonlSink, wandb_has_credentials
from comlrl.utils import read_checkpoint_metadata


def test_jsonl_fresh_run_replaces_and_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (4, 8, 12, 16):
        sink.log({"env_step": step, "x": step / 4})
    sink.close()
    with open(path, "a") as f:
        f.write('{"env_step": 20, "x": ')  # a row cut short by a crash
    resumed = JsonlSink(path, keep_until_step=8)
    resumed.log({"env_step": 12, "x": 30.0})
    resumed.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"env_step": 4, "x": 1.0}, {"env_step": 8, "x": 2.0}, {"env_step": 12, "x": 30.0}]
    JsonlSink(path).close()
    assert path.read_text() == ""


def test_jsonl_resume_keeps_only_its_own_runs_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for run in ("other", "mine"):
        sink = JsonlSink(path, run_id=run) if run == "other" else JsonlSink(path, run_id=run, keep_until_step=99)
        sink.log({"env_step": 4, "who": run})
        sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"env_step": 4, "who": "mine", "run_id": "mine"}]


def test_credentials_detection(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_has_credentials()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_has_credentials()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_has_credentials()


def test_unknown_wandb_keys_fail_when_the_trainer_is_built(make_trainer):
    with pytest.raises(ConfigError, match="unknown key"):
        make_trainer(trainer_kwargs={"wandb_config": {"project": "p", "projet": "typo"}})
    with pytest.raises(ConfigError, match="wandb_config must be a dict"):
        make_trainer(trainer_kwargs={"wandb_config": "my-project"})


def test_resume_without_identity_continues_the_checkpoints_wandb_run(make_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_config = {"project": "comlrl-tests", "name": "identity", "dir": str(tmp_path)}
    d = tmp_path / "ckpt"
    make_trainer(num_train_epochs=1, trainer_kwargs={"wandb_config": wandb_config}).train(checkpoint_dir=d)
    identity = read_checkpoint_metadata(d / "checkpoint-1")["wandb"]
    assert identity["project"] == "comlrl-tests" and identity["id"]
    resumed = make_trainer(num_train_epochs=2, trainer_kwargs={"wandb_config": wandb_config})
    resumed.train(resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)
    assert read_checkpoint_metadata(d / "checkpoint-2")["wandb"]["id"] == identity["id"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(identity["id"]) for r in runs)
