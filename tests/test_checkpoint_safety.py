"""Nothing lost, nothing leaked: a locked checkpoint directory, a state covered by the manifest's
hash and checked field by field, a planted W&B identity refused, train() retried after an
interruption, non-finite training stopped, a failed write stopping the run at the right step."""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comlrl import CheckpointDirError, CheckpointError, ConfigError, ResumeMismatchError, RewardError, TrainingError
from comlrl.checkpoint import files
from comlrl.engine.timing import PhaseTimer
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

from helpers import assert_bit_exact, never_stepped, rows, state_of

WORKER = Path(__file__).with_name("safety_worker.py")


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and p.name != ".comlrl.lock"}


def forge(checkpoint: Path, edit_state=None, edit_manifest=None) -> None:
    """Edit a checkpoint's state and re-hash everything, as a deliberate forger would: what the
    field checks must catch, beyond what the hashes catch."""
    state = json.loads((checkpoint / files.STATE_FILE).read_text())
    if edit_state:
        edit_state(state)
    raw = json.dumps(state, indent=1, sort_keys=True).encode()
    (checkpoint / files.STATE_FILE).write_bytes(raw)
    manifest = json.loads((checkpoint / files.MANIFEST_FILE).read_text())
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    body["files"][files.STATE_FILE] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if edit_manifest:
        edit_manifest(body)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (checkpoint / files.MANIFEST_FILE).write_text(json.dumps({**body, "sha256": digest}))


@pytest.fixture
def run(make_trainer, tmp_path):
    d = tmp_path / "run"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=d)
    return d


# --- 1. one run per directory ----------------------------------------------------------------------

def test_a_second_trainer_on_a_locked_directory_is_refused_and_touches_nothing(make_trainer, run):
    from comlrl.checkpoint.lock import DirectoryLock

    holder = DirectoryLock(run)  # as a running train() holds it
    before = snapshot(run)
    with pytest.raises(CheckpointDirError, match=f"{run.name} is in use by another training run \\(pid {os.getpid()}"):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert snapshot(run) == before
    holder.release()  # released: the directory is usable again
    make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)


def _worker(run_dir: Path, *args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), str(run_dir), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_two_processes_on_one_directory(make_trainer, tmp_path):
    """A second process is refused at once; the first finishes with every checkpoint and row, and
    resuming it is exact. A kill -9 releases the lock."""
    d = tmp_path / "shared"
    go_on = tmp_path / "go-on"  # the first run waits at its second step until the second was refused
    first = _worker(d, "--epochs", "3", "--hold", str(go_on))
    deadline = time.time() + 120
    while not (d / ".comlrl.lock").exists() or not (d / "metrics.jsonl").exists():
        assert time.time() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.1)
    second = _worker(d, "--epochs", "3")
    out, err = second.communicate(timeout=300)
    assert second.returncode != 0 and "in use by another training run" in err
    go_on.touch()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert sorted(p.name for p in d.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert [r["env_step"] for r in rows(d)] == [4 * i for i in range(1, 13)]
    full = make_trainer(num_train_epochs=3)
    full.train(checkpoint_dir=tmp_path / "full")
    resumed = make_trainer(num_train_epochs=3)
    resumed.train(resume_from_checkpoint=d / "checkpoint-2", checkpoint_dir=tmp_path / "copy")
    assert_bit_exact(state_of(full), state_of(resumed))
    # kill -9 while holding the lock: the OS releases it.
    victim = _worker(tmp_path / "killed", "--epochs", "50", "--slow", "0.3")
    while not (tmp_path / "killed" / "metrics.jsonl").exists():
        assert victim.poll() is None, victim.communicate()
        time.sleep(0.1)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    latest = find_latest_checkpoint(tmp_path / "killed")
    make_trainer(num_train_epochs=1).train(checkpoint_dir=tmp_path / "killed") if latest is None else \
        make_trainer(num_train_epochs=60).train(resume_from_checkpoint=latest, checkpoint_dir=tmp_path / "killed")


# --- 2. a checkpoint cannot steer W&B ---------------------------------------------------------------

@pytest.mark.parametrize("identity", [
    {"id": "abc123", "settings": {"base_url": "https://collector.example"}},
    {"id": "abc123", "dir": "/etc"},
    {"id": "abc123", "project": {"nested": "dict"}},
])
def test_a_planted_identity_never_reaches_wandb_init(make_trainer, run, monkeypatch, identity):
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs))
    forge(run / "checkpoint-2", lambda state: state.update(wandb=identity))
    resumed = make_trainer(num_train_epochs=3, trainer_kwargs={"wandb_config": {"project": "mine"}})
    with pytest.raises(CheckpointError, match="W&B identity"):
        resumed.train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert calls == []


@pytest.mark.parametrize("trackers, words", [
    ({"mlflow": {"run_id": "a1b2", "experiment_id": "1", "tracking_uri": "https://collector.example"}},
     "MLflow identity must hold exactly"),
    ({"mlflow": {"run_id": "../../runs/x", "experiment_id": "1"}}, "'run_id' must be a plain id"),
    ({"mlflow": {"run_id": ["a1b2"], "experiment_id": "1"}}, "'run_id' must be a plain id"),
    ({"mlflow": "a1b2"}, "MLflow identity must be an object"),
    ({"neptune": {"id": "a1b2"}}, "unknown tracker"),
    ("mlflow", "'trackers' must be an object"),
])
def test_a_planted_tracker_identity_never_reaches_mlflow(make_trainer, run, monkeypatch, tmp_path, trackers, words):
    from mlflow import tracking

    monkeypatch.setattr(tracking, "MlflowClient", lambda **kwargs: pytest.fail("MLflow was contacted"))
    forge(run / "checkpoint-2", lambda state: state.update(trackers=trackers))
    with pytest.raises(CheckpointError, match=words):
        read_checkpoint_metadata(run / "checkpoint-2")
    resumed = make_trainer(num_train_epochs=3, report_to=["jsonl", "mlflow"],
                           mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(CheckpointError, match=words):
        resumed.train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)


# --- 3. every byte and field resume trusts ---------------------------------------------------------

def test_one_flipped_bit_in_the_state_is_refused_and_nothing_is_deleted(make_trainer, run):
    state_file = run / "checkpoint-1" / files.STATE_FILE
    raw = bytearray(state_file.read_bytes())
    at = raw.index(b'"checkpoint": 1')
    raw[at + len('"checkpoint": ')] ^= 0x01  # 1 -> 0
    state_file.write_bytes(bytes(raw))
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-1", checkpoint_dir=run)
    assert snapshot(run) == before  # in particular checkpoint-1 and checkpoint-2 are still there
    assert find_latest_checkpoint(run) == run / "checkpoint-2"
    (run / "checkpoint-2" / files.MANIFEST_FILE).write_text("{}")
    assert find_latest_checkpoint(run) is None  # a damaged newest falls back; here both are damaged


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["counters"].update(checkpoint=0), "its state says checkpoint 0"),
    (lambda s: s["counters"].update(checkpoint=-5), "counter 'checkpoint' must be a non-negative int"),
    (lambda s: s["counters"].update(epoch="2"), "counter 'epoch' must be a non-negative int"),
    (lambda s: s["counters"].update(epoch=9), "epoch 9 is beyond num_train_epochs"),
    (lambda s: s.update(run_id="not-hex"), "'run_id' must be 32 lowercase hex"),
    (lambda s: s.pop("rng"), "'rng' is missing"),
    (lambda s: s["log_window"]["counts"].update(x=1), "'log_window' is malformed"),
    (lambda s: s["optimizers"]["agent-0"]["param_groups"][0].update(betas=[0.5, 0.5]),
     "param_groups\\[0\\].betas is \\[0.5, 0.5\\], while this run.s config gives"),
    (lambda s: s["optimizers"]["agent-0"].update(param_groups="x"), "optimizers\\['agent-0'\\] is malformed"),
    (lambda s: s.update(launch={"config_file": 3, "config": {"trainer": {}}}), "'launch' must be null or"),
])
def test_edited_fields_are_refused_by_name(make_trainer, run, edit, words):
    forge(run / "checkpoint-2", edit)
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=words):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)
    assert snapshot(run) == before


def test_the_file_list_is_complete_by_construction(make_trainer, run):
    forge(run / "checkpoint-2", edit_manifest=lambda body: body["files"].pop("agent-1/model.safetensors"))
    with pytest.raises(CheckpointError, match="missing \\['agent-1/model.safetensors'\\]"):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=run / "checkpoint-2", checkpoint_dir=run)


def test_pruning_trusts_only_verified_checkpoints_of_its_run(make_trainer, tmp_path):
    d = tmp_path / "prune"
    make_trainer(num_train_epochs=2).train(checkpoint_dir=d)
    # A checkpoint-9 that claims this run but does not verify is neither pruned nor trusted.
    (d / "checkpoint-9").mkdir()
    (d / "checkpoint-9" / files.MANIFEST_FILE).write_text("{}")
    with pytest.raises(CheckpointDirError, match="checkpoint-9, which does not verify"):
        make_trainer(num_train_epochs=3).train(resume_from_checkpoint=d / "checkpoint-2", checkpoint_dir=d,
                                               checkpoint_total_limit=1)
    assert (d / "checkpoint-1").is_dir() and (d / "checkpoint-2").is_dir()


def test_a_changed_closure_value_is_a_changed_reward(make_trainer, run):
    def reward_with(target):
        def reward(completions1, completions2):
            return [float(len(b) > target * len(a)) for a, b in zip(completions1, completions2)]
        return reward

    d = run.parent / "closure"
    make_trainer(num_train_epochs=1, reward_func=reward_with(2)).train(checkpoint_dir=d)
    with pytest.raises(ResumeMismatchError, match="reward_func"):
        make_trainer(num_train_epochs=2, reward_func=reward_with(3)).train(
            resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)
    make_trainer(num_train_epochs=2, reward_func=reward_with(2)).train(
        resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)


_MEMO: dict = {}  # a reward's cache, filled as it runs


def memo_reward(completions1, completions2):
    return [_MEMO.setdefault((a, b), float(len(b) > 2 * len(a))) for a, b in zip(completions1, completions2)]


def test_a_reward_that_fills_a_cache_still_resumes(make_trainer, run):
    """Mutable module values (a memo dict) are not part of a reward's fingerprint: filled during
    the run, they must not make the run look changed (in this process or a new one)."""
    _MEMO.clear()
    d = run.parent / "memo"
    make_trainer(num_train_epochs=1, reward_func=memo_reward).train(checkpoint_dir=d)
    assert _MEMO  # filled
    make_trainer(num_train_epochs=2, reward_func=memo_reward).train(
        resume_from_checkpoint=d / "checkpoint-1", checkpoint_dir=d)


# --- 4. train() called again after an interruption ---------------------------------------------------

@pytest.mark.parametrize("call", [7, 8, "after-step-4"], ids=["before-agent-0", "between-agents", "step-done"])
def test_train_again_after_an_exception_equals_an_uninterrupted_run(make_trainer, tmp_path, monkeypatch, call):
    import comlrl.engine.trainer as magrpo

    settings = dict(num_train_epochs=2, rollout_buffer_size=2, train_batch_size=1)
    full = make_trainer(output_dir=str(tmp_path / "full"), **settings)
    full.train(checkpoint_dir=tmp_path / "full")
    flaky = make_trainer(output_dir=str(tmp_path / "flaky"), **settings)
    apply, calls = magrpo.apply_gradients, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        # One call per agent and optimizer step: calls 7 and 8 are agents 0 and 1 of the second
        # step of the second buffer (half a buffer done; with call 8, half an optimizer step too).
        if len(calls) == call:
            raise KeyboardInterrupt
        return apply(*args, **kwargs)

    phase = PhaseTimer.__call__

    @contextlib.contextmanager
    def interrupted_after(self, name):
        # the second buffer's second step finishes (every agent updated, global_step counted), and
        # the interruption lands as its "update" phase closes (where CUDA synchronises)
        with phase(self, name):
            yield
        if name == "update":
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt

    if call == "after-step-4":
        monkeypatch.setattr(PhaseTimer, "__call__", interrupted_after)
    else:
        monkeypatch.setattr(magrpo, "apply_gradients", interrupted)
    with pytest.raises(KeyboardInterrupt):
        flaky.train(checkpoint_dir=tmp_path / "flaky")
    if call == "after-step-4":
        assert flaky.state.global_step == 4
    else:
        assert flaky.state.global_step == 3 and any(p.grad is not None for m in flaky.agents for p in m.parameters())
    flaky.train(checkpoint_dir=tmp_path / "flaky")  # the notebook habit: just call it again
    assert_bit_exact(state_of(full), state_of(flaky))
    assert rows(tmp_path / "full") == rows(tmp_path / "flaky")  # no row lost or doubled


# --- 5. non-finite training ----------------------------------------------------------------------

def test_a_diverging_learning_rate_stops_before_anything_non_finite_is_saved(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=3, agent_learning_rate=1e10, max_grad_norm=None)
    with pytest.raises(TrainingError, match="not finite|non-finite"):
        trainer.train(checkpoint_dir=tmp_path / "div")
    for checkpoint in (tmp_path / "div").glob("checkpoint-*"):
        from safetensors.torch import load_file

        weights = load_file(str(checkpoint / "agent-0" / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values())
    logged = (tmp_path / "div" / "metrics.jsonl").read_text()
    assert "NaN" not in logged and "Infinity" not in logged
    [json.loads(line) for line in logged.splitlines()]  # strict JSON


def test_huge_rewards_stop_at_once_or_skip_when_asked(make_trainer, tmp_path):
    with pytest.raises(RewardError, match="float32 range"):
        make_trainer(reward_func=lambda a, b: [1e39] * len(a)).train()
    huge = make_trainer(num_train_epochs=1, reward_func=lambda a, b: [float(len(x)) * 1e36 for x in a])
    with pytest.raises(TrainingError, match="gradient of agent 0 is not finite"):
        huge.train()
    assert huge.state.global_step == 0 and all(never_stepped(o) for o in huge.optimizers)
    skipping = make_trainer(num_train_epochs=1, nonfinite="skip", output_dir=str(tmp_path / "skip"),
                            reward_func=lambda a, b: [float(len(x)) * 1e36 for x in a])
    skipping.train()
    logged = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("train/skipped_steps", 0) for r in logged) == 4 and skipping.state.global_step == 0
    assert all(sum(r.get(f"agent_{a}/skipped_steps", 0) for r in logged) == 4 for a in range(2))


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_one_agent_non_finite_gradient_is_that_agents_alone(make_trainer, tmp_path, nonfinite):
    """Agent 1's gradient is infinite at every step: 'raise' names it and says agent 0 of the step
    was updated; 'skip' drops agent 1's updates only, and agent 0 trains."""
    trainer = make_trainer(num_train_epochs=1, nonfinite=nonfinite, output_dir=str(tmp_path / nonfinite))
    before = state_of(trainer)
    next(trainer.agents[1].parameters()).register_hook(lambda g: g * float("inf"))
    if nonfinite == "raise":
        with pytest.raises(TrainingError, match=r"gradient of agent 1 is not finite.*already updated agent 0"):
            trainer.train()
        assert trainer.state.global_step == 0 and not never_stepped(trainer.optimizers[0])
        assert never_stepped(trainer.optimizers[1])
        return
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("agent_1/skipped_steps", 0) for r in logged) == 4
    assert not any("agent_0/skipped_steps" in r or "train/skipped_steps" in r for r in logged)
    assert trainer.state.global_step == 4 and never_stepped(trainer.optimizers[1])
    after = state_of(trainer)
    assert all(torch.equal(after[k], before[k]) for k in after if k.startswith("agent-1."))
    assert not never_stepped(trainer.optimizers[0]) and float(trainer.optimizers[0].state_dict()["state"][0]["step"]) == 4
    assert not torch.equal(after["agent-0.param.model.embed_tokens.weight"], before["agent-0.param.model.embed_tokens.weight"])


# --- 6. a failed write ---------------------------------------------------------------------------

@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_next_step_with_the_previous_checkpoint_intact(tmp_path):
    d = tmp_path / "full-disk"
    worker = _worker(d, "--epochs", "4", "--fail-after", "1")
    out, err = worker.communicate(timeout=600)
    assert worker.returncode != 0
    assert "writing checkpoint-2" in err and "File too large" in err and "previous checkpoint is intact" in err
    assert sorted(p.name for p in d.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]  # no temp left
    assert find_latest_checkpoint(d) == d / "checkpoint-1"
    logged = rows(d)
    # Stopped before the first optimizer step after the failed save: epoch 2 complete, nothing more.
    assert logged[-1]["global_step"] == 8 and logged[-1]["env_step"] == 32


# --- 7. limits checked up front --------------------------------------------------------------------

def test_max_new_tokens_beyond_the_context_is_refused(make_trainer):
    # Refused before any sampling (construction accepts it: CoMLRL builds trainers with such settings).
    trainer = make_trainer(max_new_tokens=100_000, trainer_kwargs={"eval_dataset": [{"prompt": "x"}]})
    for call in (trainer.train, trainer.evaluate):
        with pytest.raises(ConfigError, match="max_new_tokens=100000 does not fit agent 0's context of 1024"):
            call()
