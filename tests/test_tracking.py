"""report_to: which trackers a run logs to, and each of them continuing the same run on resume with
every step once (metrics.jsonl, TensorBoard, MLflow; W&B in test_logging.py)."""

import re
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from comlrl import ConfigError, MAGRPOConfig
from comlrl.engine.config import resumable_fields
from comlrl.engine.loop import RunLoop
from comlrl.tracking import StepFilter, active_trackers
from comlrl.tracking.tensorboard import read_scalars
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

from helpers import forked, rows, run_forked, stop, worker_errors

EVAL = [{"prompt": p} for p in ("Tell a joke about rain:", "Name three colours:")]
TRACKED = dict(eval_interval=4, eval_num_samples=2, report_to=["jsonl", "tensorboard", "mlflow"])


# --- report_to --------------------------------------------------------------------------------------

def test_report_to_values():
    assert MAGRPOConfig().report_to is None
    assert MAGRPOConfig(report_to="none").report_to == []
    assert MAGRPOConfig(report_to=["TensorBoard", "jsonl", "jsonl"]).report_to == ["tensorboard", "jsonl"]
    assert MAGRPOConfig(report_to="all").report_to == ["jsonl", "tensorboard", "mlflow", "wandb"]  # all installed
    assert {"report_to", "tensorboard_dir", "mlflow_tracking_uri", "mlflow_experiment_name",
            "mlflow_run_name"} <= resumable_fields(MAGRPOConfig)
    for bad, words in [(dict(report_to="neptune"), "unknown tracker"),
                       (dict(report_to=["all", "wandb"]), "stand alone"), (dict(report_to=3), "tracker name"),
                       (dict(mlflow_run_name="x"), "used only when report_to includes 'mlflow'"),
                       (dict(report_to="jsonl", tensorboard_dir="tb"), "includes 'tensorboard'"),
                       (dict(report_to="mlflow", mlflow_tracking_uri="http://me:secret@host:5000"), "credentials")]:
        with pytest.raises(ConfigError, match=words):
            MAGRPOConfig(**bad)
    with pytest.raises(ConfigError, match="did you mean 'tensorboard_dir'"):
        MAGRPOConfig(logging_dir="runs")


def test_a_missing_tracker_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    from comlrl._imports import install_hint

    with pytest.raises(ConfigError, match=re.escape(install_hint("mlflow"))):
        MAGRPOConfig(report_to=["jsonl", "mlflow"])
    assert "mlflow" not in MAGRPOConfig(report_to="all").report_to


def test_the_default_is_comlrls_behaviour(caplog):
    assert active_trackers(None, None) == ["jsonl"]
    assert active_trackers(None, {"project": "p"}) == ["jsonl", "wandb"]
    assert active_trackers([], {"project": "p"}) == [] and "leaves W&B out" in caplog.text
    assert active_trackers(["wandb", "mlflow", "jsonl"], None) == ["jsonl", "mlflow", "wandb"]


def test_report_to_none_logs_nowhere_and_leaving_wandb_out_ignores_wandb_config(make_trainer, tmp_path, monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("W&B was not asked for"))
    make_trainer(num_train_epochs=1, report_to="none", trainer_kwargs={"wandb_config": {"project": "p"}}).train(
        checkpoint_dir=tmp_path / "none")
    assert not (tmp_path / "none" / "metrics.jsonl").exists()
    assert read_checkpoint_metadata(tmp_path / "none" / "checkpoint-1")["wandb"] is None
    make_trainer(num_train_epochs=1, report_to="tensorboard", tensorboard_dir=str(tmp_path / "tb"),
                 trainer_kwargs={"wandb_config": {"project": "p"}}).train(checkpoint_dir=tmp_path / "tb-only")
    assert not (tmp_path / "tb-only" / "metrics.jsonl").exists()
    (log_dir,) = (tmp_path / "tb").iterdir()
    assert [s for s, _ in read_scalars(log_dir)["train/reward_mean"]] == [4, 8, 12, 16]


def test_step_filter_sends_each_key_and_step_once(caplog):
    f = StepFilter({"loss": {8: 1.0}, "timing/step": {8: 0.5}}, "Store")
    assert f.new_values({"env_step": 4, "loss": 2.0, "epoch": 0.5, "flag": True, "name": "x"}, 4) == \
        {"loss": 2.0, "epoch": 0.5}
    assert f.new_values({"epoch": 0.5, "eval/score": 3.0}, 4) == {"eval/score": 3.0}  # same step: only what is new
    assert f.new_values({"loss": 1.0, "timing/step": 0.7, "epoch": 1.0}, 8) == {"epoch": 1.0}  # stored: not again
    assert "Store already holds" not in caplog.text
    assert f.new_values({"loss": 5.0}, 8) == {} and f.differing == []  # step 8 of loss is done in this run
    g = StepFilter({"loss": {8: 1.0}}, "Store")
    assert g.new_values({"loss": 1.5}, 8) == {} and g.differing == [("loss", 8)]
    assert "Store already holds loss=1.0 at step 8" in caplog.text


def test_saved_tracker_identities_are_plain_ids():
    from comlrl import CheckpointError
    from comlrl.tracking import check_tracker_identities

    assert check_tracker_identities(None, "x") == {}  # a checkpoint written before trackers were saved
    ok = {"mlflow": {"run_id": "0f3c9e1d2b4a", "experiment_id": "7"}}
    assert check_tracker_identities(ok, "x") == ok and check_tracker_identities({"mlflow": None}, "x") == {}
    with pytest.raises(CheckpointError, match="'experiment_id' must be a plain id"):
        check_tracker_identities({"mlflow": {"run_id": "a", "experiment_id": "1 OR 1=1"}}, "x")


# --- each step once after a crash ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def mlflow_db_template(tmp_path_factory):
    """An MLflow sqlite store with its tables created (that takes seconds; copying it does not)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(mlflow_db_template, tmp_path):
    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_mlflow_tracker_continues_its_run_or_starts_a_new_one(mlflow_uri, caplog):
    from comlrl.tracking.mlflow import MlflowTracker

    mine, other = "a" * 32, "b" * 32
    first = MlflowTracker(tracking_uri=mlflow_uri, experiment_name="e", run_config={"lr": 0.1, "tags": [1]},
                          comlrl_run_id=mine)
    first.log({"env_step": 4, "eval/acc@1": 0.5, "loss": 1.0, "epoch": 0.5}, 4)
    first.log({"env_step": 4, "epoch": 0.5}, 4)
    first.close(success=False)
    assert "logging ['eval/acc@1'] as ['eval/acc_1']" in caplog.text
    again = MlflowTracker(tracking_uri=mlflow_uri, identity=first.identity(), resume_step=4, comlrl_run_id=mine)
    assert again.client.get_run(first.run_id).info.status == "RUNNING"
    again.log({"env_step": 4, "eval/acc@1": 0.5, "loss": 1.0, "epoch": 0.5}, 4)
    again.log({"env_step": 8, "loss": 0.5}, 8)
    again.close()
    run = again.client.get_run(first.run_id)
    assert again.run_id == first.run_id and run.info.status == "FINISHED"
    assert mlflow_history(again.client, first.run_id) == {"loss": [(4, 1.0), (8, 0.5)], "eval/acc_1": [(4, 0.5)],
                                                          "epoch": [(4, 0.5)]}
    assert run.data.params == {"lr": "0.1", "tags": "[1]"} and run.data.tags["comlrl.run_id"] == mine
    gone = MlflowTracker(tracking_uri=mlflow_uri, identity={"run_id": "f" * 32, "experiment_id": "1"}, resume_step=4,
                         experiment_name="e", comlrl_run_id=mine)
    assert gone.run_id != first.run_id and "not on this tracking server" in caplog.text
    foreign = MlflowTracker(tracking_uri=mlflow_uri, identity=first.identity(), resume_step=4, experiment_name="e",
                            comlrl_run_id=other)
    assert foreign.run_id not in (first.run_id, gone.run_id) and "another comlrl run's" in caplog.text
    fresh = MlflowTracker(tracking_uri=mlflow_uri, identity=first.identity(), resume_step=None, experiment_name="e",
                          comlrl_run_id=mine)  # a fresh run never continues an identity
    assert fresh.run_id != first.run_id
    for tracker in (gone, foreign, fresh):
        tracker.close()


def _same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def assert_each_step_once_and_equal(got, expected, what):
    """``{key: [(step, value)]}``: every key's steps unique, and those of ``expected`` with its
    values. Timings are wall-clock, and a resumed run's first row lacks the checkpoint's own
    ``timing/checkpoint``: for them, only each step once."""
    assert sorted(got) == sorted(expected), what
    for key in expected:
        steps = [s for s, _ in got[key]]
        assert len(steps) == len(set(steps)), (what, key, steps)
        if not key.startswith("timing/"):
            assert steps == [s for s, _ in expected[key]], (what, key)
            assert all(_same(a, b) for (_, a), (_, b) in zip(got[key], expected[key])), (what, key, got[key],
                                                                                           expected[key])


def mlflow_history(client, run_id):
    keys = client.get_run(run_id).data.metrics
    return {k: sorted(((m.step, m.value) for m in client.get_metric_history(run_id, k)), key=lambda p: p[0])
            for k in keys}


def tensorboard_history(checkpoint_dir):
    (log_dir,) = (Path(checkpoint_dir) / "tensorboard").iterdir()
    return {k: sorted(v, key=lambda p: p[0]) for k, v in read_scalars(log_dir).items()}


def only_run(client, experiment):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


class Crash(Exception):
    pass


def test_an_interrupted_run_resumes_into_the_same_runs_with_each_step_once(make_trainer, tmp_path, mlflow_uri,
                                                                             monkeypatch):
    """Rows: eval 0, 4, 8, 12, 16, checkpoint-1, eval 16, 20, 24, crash; resumed from checkpoint-1,
    the eval row at 16 and the rows at 20 and 24 are redone. TensorBoard and MLflow end as an
    uninterrupted run's: one run each, every step of every metric once, the same values."""
    from mlflow.tracking import MlflowClient

    def build(experiment):
        return make_trainer(mlflow_experiment_name=experiment, mlflow_tracking_uri=mlflow_uri, **TRACKED,
                            trainer_kwargs={"eval_dataset": EVAL})

    build("reference").train(checkpoint_dir=tmp_path / "reference")
    original, written = RunLoop._write_row, []

    def write_then_crash(self, row):
        out = original(self, row)
        written.append(out["env_step"])
        if len(written) == 8:
            raise Crash
        return out

    monkeypatch.setattr(RunLoop, "_write_row", write_then_crash)
    with pytest.raises(Crash):
        build("resumed").train(checkpoint_dir=tmp_path / "run")
    monkeypatch.setattr(RunLoop, "_write_row", original)
    checkpoint = find_latest_checkpoint(tmp_path / "run")
    meta = read_checkpoint_metadata(checkpoint)
    assert meta["env_step"] == 16 and written == [0, 4, 8, 12, 16, 16, 20, 24]
    client = MlflowClient(tracking_uri=mlflow_uri)
    crashed = only_run(client, "resumed")
    assert crashed.info.status == "FAILED" and meta["trackers"] == {
        "mlflow": {"run_id": crashed.info.run_id, "experiment_id": crashed.info.experiment_id}}
    assert [s for s, _ in mlflow_history(client, crashed.info.run_id)["train/reward_mean"]][-1] == 24
    assert [s for s, _ in tensorboard_history(tmp_path / "run")["train/reward_mean"]][-1] == 24  # logged past it

    build("resumed").train(resume_from_checkpoint=checkpoint, checkpoint_dir=tmp_path / "run")
    assert rows(tmp_path / "run") == rows(tmp_path / "reference")
    assert_each_step_once_and_equal(tensorboard_history(tmp_path / "run"), tensorboard_history(tmp_path / "reference"),
                                    "tensorboard")
    resumed, reference = only_run(client, "resumed"), only_run(client, "reference")
    assert resumed.info.run_id == crashed.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.tags["comlrl.run_id"] == meta["run_id"]
    assert_each_step_once_and_equal(mlflow_history(client, resumed.info.run_id),
                                    mlflow_history(client, reference.info.run_id), "mlflow")


# --- a real MLflow server, a real kill -9 -----------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free local port with a sqlite store; stopped at the end."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = open(root / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts"),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.time() + 240
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited: {(root / 'server.log').read_text()[-3000:]}")
            try:
                if opener.open(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"mlflow server did not answer in 240 s: {(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, None)):  # its graceful shutdown took 10 s
            try:
                os.killpg(server.pid, sig)  # the whole group: the server's workers too
            except ProcessLookupError:
                break
            try:
                server.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        server.wait()
        log.close()


def run_worker(run_dir, experiment, uri, stall_after=0):
    """Run the worker to the end, or (stall_after) until it logged that many rows, then kill -9 it."""
    import tracking_worker

    if not stall_after:
        run_forked(tracking_worker.main, run_dir, experiment, uri)
        return None
    worker = forked(tracking_worker.main, run_dir, experiment, uri, stall_after)
    deadline = time.time() + 300
    try:
        while not (run_dir / "stalled").exists():
            assert worker.is_alive() and time.time() < deadline, worker_errors(run_dir)
            time.sleep(0.05)
    finally:
        stop(worker)  # SIGKILL: stalled where it should be, or the test has failed
    return int((run_dir / "stalled").read_text())


@pytest.mark.slow
def test_mlflow_server_run_killed_and_resumed_has_each_step_once(mlflow_server, tmp_path):
    """A worker logging to a real MLflow server is killed with SIGKILL after checkpoint-1 and two
    rows past it, then resumed: the experiment holds one run whose history equals an uninterrupted
    run's, every step of every metric once (and so does TensorBoard)."""
    from mlflow.tracking import MlflowClient

    run_worker(tmp_path / "reference", "reference", mlflow_server)
    killed_at = run_worker(tmp_path / "run", "resumed", mlflow_server, stall_after=8)
    checkpoint = find_latest_checkpoint(tmp_path / "run" / "ckpt")
    meta = read_checkpoint_metadata(checkpoint)
    client = MlflowClient(tracking_uri=mlflow_server)
    crashed = only_run(client, "resumed")
    before = mlflow_history(client, crashed.info.run_id)
    assert meta["env_step"] == 16 and killed_at == 24 and [s for s, _ in before["train/reward_mean"]][-1] == 24
    assert crashed.info.status == "RUNNING"  # killed: nobody closed it
    run_worker(tmp_path / "run", "resumed", mlflow_server)

    resumed, reference = only_run(client, "resumed"), only_run(client, "reference")
    assert resumed.info.run_id == meta["trackers"]["mlflow"]["run_id"] == crashed.info.run_id
    assert resumed.info.status == "FINISHED" and resumed.data.tags["comlrl.run_id"] == meta["run_id"]
    got, expected = mlflow_history(client, resumed.info.run_id), mlflow_history(client, reference.info.run_id)
    assert_each_step_once_and_equal(got, expected, "mlflow")
    assert_each_step_once_and_equal(tensorboard_history(tmp_path / "run" / "ckpt"),
                                    tensorboard_history(tmp_path / "reference" / "ckpt"), "tensorboard")
    assert rows(tmp_path / "run" / "ckpt") == rows(tmp_path / "reference" / "ckpt")

    print(f"\nMLflow run {resumed.info.run_id} ({resumed.info.status}): killed at env_step {killed_at} after "
          f"checkpoint env_step {meta['env_step']}, resumed; {len(got)} metrics, each step once")
    print(f"{'metric':<38}{'steps':>6}  {'first..last':<12}  equal to uninterrupted")
    for key in sorted(got):
        steps = [s for s, _ in got[key]]
        same = "steps only (wall-clock)" if key.startswith("timing/") else "yes"
        print(f"{key:<38}{len(steps):>6}  {f'{steps[0]}..{steps[-1]}':<12}  {same}")
    print("train/reward_mean by step (resumed run | uninterrupted run):")
    for (step, value), (_, ref) in zip(got["train/reward_mean"], expected["train/reward_mean"]):
        note = "   <- logged before the kill; redone after it, not sent again" if 16 < step <= killed_at else ""
        print(f"  {step:>4}  {value:.6f} | {ref:.6f}{note}")


def test_a_resumed_tensorboard_file_sorts_after_the_interrupted_ones(tmp_path):
    """TensorBoard applies a purge marker to the files before it in name order; names hold the
    creation second then a per-process counter compared as text ("...10" < "...9"), so a resume in
    the same second could write a file that sorts first (seen in the full suite). The resumed writer
    waits for the next second."""
    import socket
    import time

    from comlrl.tracking.tensorboard import _after_existing_files

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now:010d}.{socket.gethostname()}.1.9").write_bytes(b"")
    _after_existing_files(tmp_path)
    assert int(time.time()) > now


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling link"])
def test_a_metrics_file_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO at metrics.jsonl blocked train() forever (read before it was checked); a directory
    gave a raw IsADirectoryError (issue 29 item 5)."""
    from comlrl import CheckpointDirError
    from comlrl.tracking.jsonl import JsonlSink

    path = tmp_path / "metrics.jsonl"
    {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir,
     "dangling link": lambda: path.symlink_to(tmp_path / "elsewhere")}[kind]()

    def expire(*_):
        raise TimeoutError("opening the metrics file blocked")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    try:
        with pytest.raises(CheckpointDirError, match="metrics file"):
            JsonlSink(path, run_id="r" * 32)
        with pytest.raises(CheckpointDirError, match="metrics file"):
            JsonlSink(path, run_id="r" * 32, keep_until_step=4)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert os.path.lexists(path) and not (tmp_path / "elsewhere").exists()  # left as it was


def test_a_metric_name_with_a_lone_surrogate_does_not_stop_tensorboard(tmp_path):
    """A name built from undecodable bytes (issue 29): written escaped, as MLflow's sink cleans its
    names, instead of a UnicodeEncodeError out of train()."""
    pytest.importorskip("tensorboard")
    from comlrl.tracking.tensorboard import TensorBoardTracker

    tracker = TensorBoardTracker(tmp_path / "tb")
    tracker.log({"reward/\udcff": 1.0, "loss": 2.0}, step=1)
    tracker.close()
    assert read_scalars(tmp_path / "tb") == {"reward/\\udcff": [(1, 1.0)], "loss": [(1, 2.0)]}


def test_an_mlflow_store_that_refuses_is_a_tracker_error_not_a_traceback(tmp_path, monkeypatch):
    """A store that cannot be written (issue 29): a TrackerError saying what to change, with any
    password of the URI hidden."""
    pytest.importorskip("mlflow")
    from types import SimpleNamespace

    from comlrl import TrackerError
    from comlrl.tracking.trackers import TrackerContext, open_trackers

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's folder would be")
    args = SimpleNamespace(mlflow_tracking_uri=f"sqlite:///{blocker}/sub/mlflow.db", mlflow_experiment_name=None,
                           mlflow_run_name=None)
    ctx = TrackerContext(folder=tmp_path, run_id="a" * 32, resume_step=None, run_config={"seed": 1}, identities={},
                         keep_at_boundary=lambda row: True)
    with pytest.raises(TrackerError, match="MLflow could not open a run at sqlite:///.*leave 'mlflow' out of "
                                           "report_to") as caught:
        open_trackers(["mlflow"], args, None, ctx)
    assert caught.value.__cause__ is None
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes
    args.mlflow_tracking_uri = "http://user:hunter2-secret@127.0.0.1:9/"  # nothing listens on port 9
    with pytest.raises(TrackerError) as caught:
        open_trackers(["mlflow"], args, None, ctx)
    assert "hunter2-secret" not in str(caught.value)
