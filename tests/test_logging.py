import json
import re

import pytest

from comlrl import ConfigError
from comlrl.tracking import JsonlSink, WandbSink, check_identity, wandb_init_kwargs
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
    JsonlSink(path).close()  # a fresh run keeps the earlier run's file beside the new one
    assert path.read_text() == ""
    kept = sorted(tmp_path.glob("metrics.*.jsonl"))
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) == 3


def test_jsonl_is_strict_json(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.log({"env_step": 1, "a": float("nan"), "b": float("inf"), "c": [1.0, float("-inf")]})
    sink.close()
    line = (tmp_path / "m.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"env_step": 1, "a": None, "b": None, "c": [1.0, None]}


def test_jsonl_resume_keeps_only_its_own_runs_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for run in ("other", "mine"):
        sink = JsonlSink(path, run_id=run) if run == "other" else JsonlSink(path, run_id=run, keep_until_step=99)
        sink.log({"env_step": 4, "who": run})
        sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"env_step": 4, "who": "mine", "run_id": "mine"}]


def test_no_credentials_means_offline(monkeypatch, tmp_path):
    """wandb's own check (wandb.login(prompt=False)) decides; without credentials: offline, no prompt."""
    import wandb

    seen = {}
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(wandb, "login", lambda **kwargs: seen.setdefault("login", kwargs) and False)

    class Run:
        id, project, entity, step, dir = "abc", "p", None, 0, str(tmp_path / "files")
        settings = type("S", (), {"_offline": True})()

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.setdefault("init", kwargs) and Run())
    Run.log = lambda self, row, step: seen.setdefault("rows", []).append(step)
    WandbSink({"project": "p"}, {}).close()
    assert "init" not in seen  # nothing logged: no (empty) W&B run is started
    sink = WandbSink({"project": "p"}, {})
    sink.log({"train/reward_mean": 0.5}, step=4)
    sink.close()
    assert seen["login"] == {"prompt": False, "verify": False} and seen["init"]["mode"] == "offline"
    assert seen["rows"] == [4] and sink.note() == "offline" and len(seen["init"]["id"]) == 8  # chosen up front


def test_comlrl_wandb_config_sections():
    run_config = {"num_agents": 2}
    kwargs = wandb_init_kwargs({"project": "p", "run_name": "r", "config_sections": {"dataset": {"name": "d"}}},
                               run_config)
    assert kwargs == {"project": "p", "entity": None, "name": "r", "config": run_config}
    assert run_config == {"num_agents": 2, "dataset": {"name": "d"}, "dataset_name": "d"}


@pytest.mark.parametrize("identity, words", [
    ({"id": "abc", "settings": {"base_url": "https://evil.example"}}, "settings"),
    ({"id": "abc", "dir": "/etc"}, "dir"),
    ({"id": 7}, "'id' must be a plain name"),
    ({"id": "abc", "project": "a/../b"}, "'project' must be a plain name"),
    ({"project": "p"}, "no 'id'"),
    ("abc", "must be a dict"),
])
def test_a_saved_identity_is_only_plain_names(identity, words):
    from comlrl import CheckpointError

    with pytest.raises(CheckpointError, match=words):
        check_identity(identity, "checkpoint x")
    assert check_identity({"id": "abc", "project": "p", "entity": "team-1"}, "x") == \
        {"id": "abc", "project": "p", "entity": "team-1"}


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
    # wandb names an offline run's folder offline-run-DATE_TIME-ID, adding "-1" when a resume lands in the same second
    pattern = rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(identity['id'])}(-\d+)?"
    assert len(runs) == 2 and all(re.fullmatch(pattern, r.name) for r in runs), [r.name for r in runs]
