"""The ``comlrl`` command line end to end (each command in a process of its own: ``python -m comlrl``
for the seed run and ``--version``, the others forked with torch already imported), and its parts
in process.

One seed run is trained once per module (2 epochs, 8 tokens, W&B offline) and then listed, resumed,
exported and plotted; the error cases check the one-line messages that name the key and the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comlrl.cli import main
from comlrl.cli.yamlconf import CliError, Document, load_document, parse_value
from helpers import finish, forked, run_cli, write_config

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "examples" / "configs" / "seed.yaml"
TWO_TURN = ROOT / "examples" / "configs" / "two_turn.yaml"
FAST = ["--max_new_tokens", "8"]
# One xdist worker runs the module, so that the seed run is trained once (not once per worker).
pytestmark = pytest.mark.xdist_group("cli")


def comlrl(*args: str, cwd: Path, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """``comlrl ARGS`` in ``cwd``: ``comlrl.cli.main`` in a process of its own, forked without
    importing torch and transformers again (``helpers.forked``); its exit status, stdout and stderr.
    (``python -m comlrl`` itself: :func:`comlrl_subprocess`.)"""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="cli-run-"))
    code = finish(forked(run_cli, out, list(args), cwd=cwd), timeout)
    result = subprocess.CompletedProcess(["comlrl", *args], code, (out / "worker.out").read_text(),
                                         (out / "worker.err").read_text())
    shutil.rmtree(out, ignore_errors=True)
    assert result.returncode == expect, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def comlrl_subprocess(*args: str, cwd: Path, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m comlrl ARGS`` in ``cwd``, a fresh interpreter: the entry point itself."""
    result = subprocess.run([sys.executable, "-m", "comlrl", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "COMLRL_DISABLE_PROGRESS": "1"})
    assert result.returncode == expect, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def wandb_flags(tmp: Path) -> list[str]:
    return ["--trainer.wandb_config", json.dumps({"project": "cli-test", "name": "seed", "dir": str(tmp / "wb"),
                                                  "mode": "offline"})]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    """The example seed config trained for its 2 epochs, a checkpoint after each."""
    work = tmp_path_factory.mktemp("cli")
    result = comlrl_subprocess("train", str(SEED), *FAST, "--checkpoint_dir", "runs/seed", *wandb_flags(work),
                               cwd=work)
    return work, work / "runs" / "seed", result


def test_train_writes_checkpoints_and_metrics(seed_run):
    work, run, result = seed_run
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["epoch"] == 2
    assert "MAGRPO trained to epoch 2" in result.stdout
    assert "logged to wandb (offline)" in result.stdout  # the config asks W&B for offline mode
    assert "Traceback" not in result.stderr


def test_a_closed_pipe_ends_a_command_quietly(seed_run, monkeypatch, capsys):
    """`comlrl checkpoints DIR --json | head -1`: the reader went away; no traceback."""
    _, run, _ = seed_run

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["checkpoints", str(run), "--json"]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_checkpoints_table(seed_run):
    work, run, _ = seed_run
    from comlrl.utils import read_checkpoint_metadata

    out = comlrl("checkpoints", str(run), cwd=work).stdout
    run_id = read_checkpoint_metadata(run / "checkpoint-2")["run_id"]
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", "epoch", "env_step", "step", "run", "id", "status"]
    assert lines[1].split()[:3] == ["checkpoint-1", "1", "16"] and lines[1].endswith("verified")
    assert lines[2].split()[:3] == ["checkpoint-2", "2", "32"] and run_id[:12] in lines[2]
    assert "--resume auto continues from checkpoint-2" in out


def test_checkpoints_table_names_a_damaged_checkpoint(seed_run, tmp_path, capsys):
    _, run, _ = seed_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    weights = copy / "checkpoint-2" / "agent-0" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["checkpoints", str(copy)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("checkpoint-2"))
    assert "NOT VERIFIED" in line and "agent-0/model.safetensors" in line and "sha256" in line
    assert "--resume auto continues from checkpoint-1" in out
    assert main(["checkpoints", str(copy), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["verified"] for r in rows] == [True, False] and rows[0]["resume_auto"]


def test_resume_auto_continues_the_same_run(seed_run, tmp_path):
    work, run, _ = seed_run
    from comlrl.utils import read_checkpoint_metadata

    copy = tmp_path / "runs" / "seed"
    shutil.copytree(run, copy)
    before = read_checkpoint_metadata(copy / "checkpoint-2")
    result = comlrl("train", str(SEED), *FAST, "--checkpoint_dir", "runs/seed", *wandb_flags(work),
                    "--resume", "auto", "--num_train_epochs", "3", cwd=tmp_path)
    assert "resuming from runs/seed/checkpoint-2" in result.stdout
    assert before["wandb"] and f"continuing W&B run {before['wandb']['id']}" in result.stdout
    after = read_checkpoint_metadata(copy / "checkpoint-3")
    assert after["run_id"] == before["run_id"] and after["epoch"] == 3 and after["env_step"] == 48
    assert after["wandb"]["id"] == before["wandb"]["id"]
    steps = [json.loads(line)["env_step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 48


def test_export_writes_loadable_agents(seed_run, tmp_path):
    work, run, _ = seed_run
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "final"
    result = comlrl("export", str(run / "checkpoint-2"), str(out), "--config", str(SEED), *FAST,
                    *wandb_flags(work), cwd=tmp_path)
    assert "agent_0, agent_1" in result.stdout
    for i in range(2):
        model = AutoModelForCausalLM.from_pretrained(out / f"agent_{i}")
        saved = load_file(str(run / "checkpoint-2" / f"agent-{i}" / "model.safetensors"))
        state = model.state_dict()
        assert saved and all((state[k] == v).all() for k, v in saved.items())


def test_export_needs_no_config_after_comlrl_train(seed_run, tmp_path, capsys):
    """Export copies the checkpoint's model folders: no config, from any working directory; with
    --config it rebuilds the trainer instead (for checkpoints older than the loadable folders),
    and both give the same weights."""
    from safetensors.torch import load_file

    work, run, _ = seed_run
    from comlrl.utils import read_checkpoint_metadata

    launch = read_checkpoint_metadata(run / "checkpoint-2")["launch"]
    assert launch["config_file"] == str(SEED)
    assert launch["config"]["trainer"]["args"]["max_new_tokens"] == 8  # the --max_new_tokens 8 override
    with_config, without = tmp_path / "with", tmp_path / "without"
    comlrl("export", str(run / "checkpoint-2"), str(with_config), "--config", str(SEED), *FAST, *wandb_flags(work),
           cwd=tmp_path)
    result = comlrl("export", str(run / "checkpoint-2"), str(without), cwd=tmp_path)
    assert "exported checkpoint-2 (epoch 2, env_step 32)" in result.stdout
    for i in range(2):
        rebuilt, copied = (load_file(str(d / f"agent_{i}" / "model.safetensors")) for d in (with_config, without))
        assert rebuilt.keys() == copied.keys() and all(torch.equal(rebuilt[k], copied[k]) for k in rebuilt)
    # Flags have nothing to change in a copy: refused, and nothing is written.
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "x"), "--trainer.num_agents", "3"]) == 2
    err = capsys.readouterr().err
    assert "export copies as they are" in err and "--config" in err and not (tmp_path / "x").exists()
    # Rebuilding from a config that contradicts the run is refused, and nothing is written.
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "x"), "--config", str(SEED),
                 "--trainer.num_agents", "3", *FAST, *wandb_flags(work)]) == 2
    assert "completions3" in capsys.readouterr().err and not (tmp_path / "x").exists()  # the reward takes 2
    assert main(["export", "--", str(run / "checkpoint-2"), str(tmp_path / "z")]) == 0  # argparse's `--`


def test_export_finds_inputs_where_training_found_them(tmp_path):
    """A data file found in the directory comlrl train ran in (not next to the config) is found
    again when exporting from elsewhere: the record keeps that directory."""
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "data").mkdir()
    shutil.copy(ROOT / "examples" / "configs" / "seed_prompts.jsonl", project / "data" / "prompts.jsonl")
    config = project / "configs" / "run.yaml"
    config.write_text(SEED.read_text().replace("train_dataset: seed_prompts.jsonl", "train_dataset: data/prompts.jsonl"))
    comlrl("train", str(config), *FAST, "--num_train_epochs", "1", "--trainer.wandb_config", "null", cwd=project)
    result = comlrl("export", str(project / "runs" / "seed" / "checkpoint-1"), str(tmp_path / "out"), cwd=tmp_path)
    assert "agent_0, agent_1" in result.stdout


def test_export_runs_no_code_a_checkpoint_names(seed_run, tmp_path, capsys):
    """A shared checkpoint names code in its record: export of a checkpoint with model folders never
    reads the record; an older one's record is made inert (its functions are never imported, and a
    record naming other code to call is refused before anything is imported)."""
    from test_checkpoint_safety import forge

    _, run, _ = seed_run
    evil = tmp_path / "evil.py"
    marker = tmp_path / "imported"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef fn(*a, **k):\n    return [1.0]\n"
                    "class Trainer:\n    pass\n")

    def planted(edit, folders=True):
        copy = tmp_path / f"copy-{len(list(tmp_path.glob('copy-*')))}"
        shutil.copytree(run / "checkpoint-2", copy / "checkpoint-2")
        forge(copy / "checkpoint-2", lambda state: (edit(state["launch"]["config"]["trainer"]),
                                                     None if folders else state.pop("folders")))
        return copy / "checkpoint-2"

    edits = [(lambda t: t.update(name=f"{evil}:Trainer"), "is a class from a file or module"),
             (lambda t: t.update(agent_model={"call": f"{evil}:fn"}), "trainer.agent_model names code to call"),
             (lambda t: t.update(model_config={"model_kwargs": {"trust_remote_code": True}}), "trust_remote_code")]
    for i, (edit, _) in enumerate(edits):  # copied folder by folder: the record is never read
        assert main(["export", str(planted(edit)), str(tmp_path / f"ok{i}")]) == 0
        assert (tmp_path / f"ok{i}" / "agent_1" / "model.safetensors").is_file()
    # A checkpoint from before the folders (simulated: its 'folders' record removed) is rebuilt from the record.
    checkpoint = planted(lambda t: t.update(reward_func=f"{evil}:fn", formatters=[f"{evil}:fn"]), folders=False)
    assert main(["export", str(checkpoint), str(tmp_path / "ok")]) == 0  # the recorded reward is never needed
    assert (tmp_path / "ok" / "agent_1" / "model.safetensors").is_file()
    for edit, words in edits:
        assert main(["export", str(planted(edit, folders=False)), str(tmp_path / "no")]) == 2
        err = capsys.readouterr().err
        assert words in err and "runs no code a checkpoint names" in err and "--config" in err
    assert not marker.exists() and not (tmp_path / "no").exists()


def test_export_of_a_python_api_run_needs_only_the_checkpoint(make_trainer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(num_train_epochs=1)
    trainer.train(checkpoint_dir=tmp_path / "run")
    assert main(["export", str(tmp_path / "run" / "checkpoint-1"), str(tmp_path / "out")]) == 0
    assert "to " + str(tmp_path / "out") + ": agent_0, agent_1" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "agent_1")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trainer.agents[1].state_dict().values()))
    # ... and never replaces a folder it did not write (the user's own final/, the run directory)
    (tmp_path / "final" / "agent_0").mkdir(parents=True)
    for out in (tmp_path / "final", tmp_path / "run"):
        assert main(["export", str(tmp_path / "run" / "checkpoint-1"), str(out)]) == 2
        assert "already holds files export did not write" in capsys.readouterr().err
    assert (tmp_path / "final" / "agent_0").is_dir() and (tmp_path / "run" / "checkpoint-1").is_dir()


def test_the_recorded_config_leaves_secrets_out():
    from comlrl.cli.launch import launch_record
    from comlrl.cli.runconfig import check_run

    doc = Document(data={"trainer": {
        "name": "MADPOIter", "agent_model": "tiny", "num_agents": 2, "reward_func": "comlrl.testing:length_ratio_reward",
        "wandb_config": {"project": "p", "settings": {"api_key": "sk-wandb"}},
        "model_config": {"model_kwargs": {"token": "hf_secret", "dtype": "float32"}},
        "train_dataset": {"rows": [{"prompt": "Say hi.", "author": "me", "token": "data, not a credential"}]},
        "args": {"comparator_api_key": "sk-secret", "comparator_api_headers": {"X-Auth-Token": "t0k"}, "dpo_beta": 0.2,
                 "comparator_api_key_env": "MY_KEY_VARIABLE"}}})
    record = launch_record(check_run(doc))
    assert record["config_file"] is None and record["cwd"]
    assert record["config"] == {"trainer": {
        "name": "MADPOIter", "agent_model": "tiny", "num_agents": 2, "reward_func": "comlrl.testing:length_ratio_reward",
        "model_config": {"model_kwargs": {"dtype": "float32"}},
        "train_dataset": {"rows": [{"prompt": "Say hi.", "author": "me", "token": "data, not a credential"}]},
        "args": {"comparator_api_headers": {}, "dpo_beta": 0.2, "comparator_api_key_env": "MY_KEY_VARIABLE"}}}
    text = json.dumps(record)
    assert not any(secret in text for secret in ("sk-secret", "sk-wandb", "hf_secret", "t0k"))
    doc.data["trainer"]["train_dataset"]["rows"][0]["weight"] = float("nan")  # strict JSON cannot hold it
    assert launch_record(check_run(doc)) is None


def test_export_refuses_a_config_that_differs(seed_run, tmp_path, capsys):
    _, run, _ = seed_run
    from comlrl.testing import tiny_model_dir

    other = tiny_model_dir(num_layers=1)  # another base model than the run's
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "x"), "--config", str(SEED),
                 "--trainer.agent_model", str(other), "--trainer.wandb_config", "null"]) == 2
    err = capsys.readouterr().err
    assert "seed.yaml does not describe the run" in err and "models[0]" in err
    assert not (tmp_path / "x").exists()


def test_plot_writes_a_png(seed_run, tmp_path):
    _, run, _ = seed_run
    out = tmp_path / "curve.png"
    result = comlrl("plot", str(run), "--out", str(out), cwd=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train/reward_mean" in result.stdout
    shutil.copy(run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    assert main(["plot", str(tmp_path), "--key", r"agent_\d+/loss"]) == 0  # not over the reward curve
    assert (tmp_path / "metrics_agent_d_loss.png").is_file() and not (tmp_path / "reward_curve.png").exists()


def test_plot_without_matplotlib_says_what_to_install(seed_run, monkeypatch, capsys):
    _, run, _ = seed_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(run)]) == 2
    from comlrl._imports import install_hint

    assert install_hint("plot") in capsys.readouterr().err


def test_version(tmp_path):
    from comlrl import __version__

    assert comlrl_subprocess("--version", cwd=tmp_path).stdout.strip() == f"comlrl {__version__}"


# --- user errors: one line naming the key and the file, exit status 2, no traceback -------------

def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("comlrl ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unknown_key_names_key_file_and_the_closest_name(tmp_path):
    config = write_config(tmp_path, args="    num_generation: 4\n")
    line = one_line_error(comlrl("train", str(config), cwd=tmp_path, expect=2))
    assert "config.yaml:9: trainer.args.num_generation: unknown key (did you mean 'num_generations'?)" in line


def test_bad_value_names_key_and_file(tmp_path):
    config = write_config(tmp_path, args="    num_generations: 0\n")
    line = one_line_error(comlrl("train", str(config), cwd=tmp_path, expect=2))
    assert "config.yaml:9: trainer.args.num_generations: must be an int >= 1" in line


def test_missing_reward_module_names_key(tmp_path):
    config = write_config(tmp_path)
    line = one_line_error(comlrl("train", str(config), "--trainer.reward_func", "no_such_rewards:score",
                                 cwd=tmp_path, expect=2))
    assert "--trainer.reward_func (trainer.reward_func): cannot import module 'no_such_rewards'" in line


def test_errors_in_process(tmp_path, capsys):
    """The other mistakes, without a subprocess each."""
    config = write_config(tmp_path)
    cases = [
        (["--num_generatons", "3"], "unrecognized argument '--num_generatons' (did you mean --num_generations?)"),
        (["--trainer", "MAGRPX"], "trainer.name: unknown trainer 'MAGRPX' (did you mean 'MAGRPO'?)"),
        (["--trainer.agent_modle", "x"], "(trainer.agent_modle): unknown key (did you mean 'agent_model'?)"),
        (["--trainer.args.learning_rate", "1"], "unknown key (did you mean 'agent_learning_rate'?)"),
        (["--num_generations", "1"], "--num_generations (trainer.args.num_generations): must be >= 2"),
        (["--trainer.reward_func", "comlrl.testing:length_ratio"], "has no attribute 'length_ratio' (did you mean "
                                                                    "'length_ratio_reward'?)"),
        (["--trainer.reward_func", "missing.py:f"], "file 'missing.py' not found"),
        (["--trainer.train_dataset", "nope.jsonl"], "(trainer.train_dataset): file 'nope.jsonl' not found"),
        (["--trainer.train_dataset", "{path: " + str(ROOT / "examples/configs/seed_prompts.jsonl") +
          ", prompt_column: text}"], "the dataset has no column 'text'; its columns: prompt"),
        (["--trainer.num_agents", "3", "--num_agents", "2"], "trainer.args.num_agents): is 2 but trainer.num_agents "
                                                               "is 3"),
        (["--resume", "auto"], "'auto' resumes from train.checkpoint_dir, which is not set"),
        (["--num_turns", "2"], "num_turns=2 needs an external_transition"),
    ]
    for extra, expected in cases:
        assert main(["train", str(config), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (extra, err)
    (tmp_path / "top.yaml").write_text("trainer:\n  name: MAGRPO\nseed: 3\n")
    assert main(["train", str(tmp_path / "top.yaml")]) == 2
    assert "top.yaml:3: seed: unknown key; seed is a config field: write it under trainer.args" in \
        capsys.readouterr().err
    (tmp_path / "dup.yaml").write_text("trainer:\n  name: MAGRPO\n  name: IAC\n")
    assert main(["train", str(tmp_path / "dup.yaml")]) == 2
    assert "dup.yaml:3: trainer.name: duplicate key" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "config file" in capsys.readouterr().err
    assert main(["export", "ckpt", "out"]) == 2
    assert "ckpt" in capsys.readouterr().err


def test_an_existing_run_is_not_overwritten_without_resume(seed_run, tmp_path):
    _, run, _ = seed_run
    shutil.copytree(run, tmp_path / "runs" / "seed")
    result = comlrl("train", str(SEED), *FAST, "--checkpoint_dir", "runs/seed", "--trainer.wandb_config", "null",
                    cwd=tmp_path, expect=2)
    line = one_line_error(result)
    assert "already holds checkpoint-1" in line and "--resume auto" in line and "nothing was loaded" in line
    assert "resume_from_checkpoint=" not in line  # the command line's advice, not the Python API's
    assert "Loading weights" not in result.stderr  # refused before any model is loaded


def test_a_refused_resume_lists_each_difference_and_starts_no_tracker(seed_run, tmp_path):
    work, run, _ = seed_run
    copy = tmp_path / "runs" / "seed"
    shutil.copytree(run, copy)
    before = {p.name for p in (work / "wb").rglob("offline-run-*")}
    result = comlrl("train", str(SEED), *FAST, "--checkpoint_dir", "runs/seed", *wandb_flags(work), "--resume",
                    "auto", "--agent_learning_rate", "0.5", "--top_k", "7", cwd=tmp_path, expect=2)
    errors = result.stderr[result.stderr.index("comlrl train: error"):].splitlines()
    assert any("agent_learning_rate" in line for line in errors[1:]) and any("top_k" in line for line in errors[1:])
    assert "continuing W&B run" not in result.stdout
    assert {p.name for p in (work / "wb").rglob("offline-run-*")} == before  # no W&B run was started


# --- the parts ------------------------------------------------------------------------------------

def test_yaml_numbers_lines_and_flag_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  args:\n    agent_learning_rate: 1e-3\n    top_k: null\n")
    doc = load_document(path)
    assert doc.data["trainer"]["args"] == {"agent_learning_rate": 1e-3, "top_k": None}
    assert doc.where(("trainer", "args", "top_k")) == "c.yaml:4: trainer.args.top_k"
    assert doc.where(("trainer", "args", "seed")) == "c.yaml: trainer.args.seed (not set in the file)"  # a default
    assert parse_value("1e-3") == 1e-3 and parse_value("[cuda:0, cuda:1]") == ["cuda:0", "cuda:1"]
    assert parse_value("null") is None and parse_value("007", as_string=True) == "007"
    doc.set(("trainer", "args", "seed"), 3, "--seed")
    assert doc.where(("trainer", "args", "seed")) == "--seed (trainer.args.seed)"
    with pytest.raises(CliError, match="is not a mapping"):
        Document(data={"trainer": {"train_dataset": "x.jsonl"}}).set(("trainer", "train_dataset", "split"), "a",
                                                                        "--trainer.train_dataset.split")


def test_registry_finds_every_family_by_any_spelling():
    from comlrl.cli.registry import available_trainers, lookup_trainer
    from comlrl.trainers.actor_critic import IACConfig, MAACTrainer
    from comlrl.trainers.reinforce import MAGRPOConfig, MAReMaxTrainer

    found, failed = available_trainers()
    assert {"MAGRPO", "MAREINFORCE", "MARLOO", "MAReMax", "IAC", "MAAC"} <= set(found), failed
    assert lookup_trainer("magrpo").config is MAGRPOConfig
    assert lookup_trainer("MAReMaxTrainer").trainer is MAReMaxTrainer
    assert lookup_trainer("IAC").config is IACConfig
    assert lookup_trainer("comlrl.trainers.actor_critic:MAACTrainer").trainer is MAACTrainer
    with pytest.raises(ValueError, match="did you mean 'MAAC'"):
        lookup_trainer("MAAX")


def test_every_config_field_is_a_flag():
    import dataclasses

    from comlrl.cli.registry import available_trainers
    from comlrl.cli.runconfig import options_for

    for entry in available_trainers()[0].values():
        flags = {flag for option in options_for(entry) for flag in option.flags}
        for f in dataclasses.fields(entry.config):
            assert f"--trainer.args.{f.name}" in flags and f"--{f.name}" in flags, (entry.name, f.name)
        assert {"--resume", "--checkpoint_dir", "--save_steps", "--trainer.reward_func"} <= flags
        export_flags = {flag for option in options_for(entry, train_section=False) for flag in option.flags}
        assert not export_flags & {"--resume", "--checkpoint_dir", "--save_steps", "--save_model"}  # export trains not
        assert f"--{dataclasses.fields(entry.config)[0].name}" in export_flags


def test_trainers_list_whole_first_sentences(capsys):
    assert main(["trainers"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["MADPOIter"].endswith("rounds of sampling, comparing against a comparator, and DPO.")
    assert lines["MAREINFORCE"].endswith('(advantage_mode="raw").')  # no reST markup
    assert all(line.rstrip().endswith((".", ")")) for line in lines.values())


def test_the_summary_names_only_the_trackers_that_ran(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import comlrl.cli.commands as commands

    out = tmp_path / "run"
    trainer = SimpleNamespace(state=SimpleNamespace(epoch=1, env_step=8, global_step=1), wandb_config=None,
                              args=SimpleNamespace(report_to=["tensorboard"], output_dir=str(out)))
    spec = SimpleNamespace(entry=SimpleNamespace(name="MAGRPO"))
    lines = []
    monkeypatch.setattr(commands, "_say", lines.append)
    commands._report(spec, trainer, {}, {}, None)
    trainer.args.report_to = None  # CoMLRL's default: metrics.jsonl
    commands._report(spec, trainer, {}, {"checkpoint_dir": str(out)}, None)
    assert lines[0].endswith("(env_step 8, 1 optimizer step)")
    assert lines[1] == "comlrl: logged to tensorboard" and "metrics.jsonl" not in "".join(lines[:2])
    assert lines[3] == f"comlrl: checkpoints in {out}; metrics in {out / 'metrics.jsonl'}"


def test_datasets_objects_and_the_tiny_model(tmp_path):
    from comlrl.cli.build import _resolve, load_dataset_spec
    from comlrl.testing import tiny_model_dir

    (tmp_path / "d.csv").write_text("text,answer\nhello,1\nworld,2\nagain,3\n")
    doc = Document(data={}, file=tmp_path / "c.yaml")
    ds = load_dataset_spec(doc, ("trainer", "train_dataset"),
                           {"path": "d.csv", "prompt_column": "text", "columns": {"answer": "label"}, "limit": 2})
    assert ds.column_names == ["prompt", "label"] and ds["prompt"] == ["hello", "world"]
    assert load_dataset_spec(doc, ("k",), ["a", "b"])["prompt"] == ["a", "b"]
    assert load_dataset_spec(doc, ("k",), [{"prompt": "a", "x": 1}])["x"] == [1]
    assert _resolve(doc, ("trainer", "agent_model"), "tiny", "model") == str(tiny_model_dir())
    assert _resolve(doc, ("trainer", "agent_model"), {"call": "comlrl.testing:tiny_model_dir"}, "model") == \
        str(tiny_model_dir())
    scale = _resolve(doc, ("trainer", "reward_processor"),
                     {"call": "comlrl.utils:RewardProcessors.scale", "factor": 3.0}, "callable")
    assert scale(2.0) == 6.0
    (tmp_path / "rewards.py").write_text("def score(a, b):\n    return [1.0] * len(a)\n")
    score = _resolve(doc, ("trainer", "reward_func"), "rewards.py:score", "callable")
    assert score.__module__ == "comlrl_files.rewards" and score(["x"], ["y"]) == [1.0]


def test_two_turn_example_config_is_valid():
    """The two-turn example parses, its functions import, and its config builds (no training)."""
    from comlrl.cli.build import _resolve
    from comlrl.cli.runconfig import check_run
    from comlrl.cli.yamlconf import load_document

    spec = check_run(load_document(TWO_TURN))
    assert spec.config.num_turns == 2 and spec.config.discount == 0.9
    transition = _resolve(spec.doc, ("trainer", "external_transition"), spec.trainer_values["external_transition"],
                          "callable")
    assert transition("p", ["draft", "notes"])[0].endswith("draft")


@pytest.mark.slow
def test_train_under_torchrun(tmp_path):
    """The same command under torchrun (2 gloo processes): one report, one set of checkpoints."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "comlrl", "train", str(SEED), *FAST, "--checkpoint_dir", "runs/ddp",
                             "--trainer.wandb_config", "null"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "COMLRL_DISABLE_PROGRESS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("MAGRPO trained to epoch 2") == 1
    assert sorted(p.name for p in (tmp_path / "runs" / "ddp").glob("checkpoint-*")) == ["checkpoint-1",
                                                                                        "checkpoint-2"]


@pytest.mark.parametrize("extra, shown", [
    (["--comparator_api_key", "VALUE-123456"], "--comparator_api_key carries a secret"),
    (["--comparator_api_key=VALUE-123456"], "set comparator_api_key_env"),
    (["--trainer.args.comparator_api_headers", "{X-Authentication: VALUE-123456}"], "comparator_api_headers carries"),
    (["--comparator_api_url", "https://judge.example/v1?key=VALUE-123456"], "a URL query"),
    (["--trainer.wandb_config.notes", "sk-" + "a" * 30], "carries a credential"),
    (["--trainer.wandb_config", "{project: p, settings: {api_key: VALUE-123456}}"], "a secret key inside a YAML"),
])
def test_a_secret_on_the_command_line_is_refused_before_anything_starts(tmp_path, capsys, extra, shown):
    """W&B records argv in its run files (as do shell history and ps): issue 29 item 6."""
    config = write_config(tmp_path)
    assert main(["train", str(config), "--trainer", "MADPOIter", *extra]) == 2
    err = capsys.readouterr().err
    assert shown in err and "VALUE-123456" not in err and "a" * 30 not in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "wandb").exists()
