"""The seed document's example, run as written (local tiny model in place of the hub name)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_seed_example_trains_checkpoints_and_resumes_into_one_wandb_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(COMLRL_DISABLE_PROGRESS="1", MPLBACKEND="Agg", NETRC=str(tmp_path / "no-netrc"))
    workdir = tmp_path / "demo"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "resume_demo.py"), "--workdir", str(workdir)],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoints = workdir / "checkpoints" / "resume-demo"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-*")) == [f"checkpoint-{i}" for i in range(1, 5)]
    rows = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    # CoMLRL's defaults: 2 prompts (8 joint actions) per optimizer step; one row per step, no duplicates.
    assert [r["env_step"] for r in rows] == [8 * i for i in range(1, 9)]
    # No credentials here: W&B ran offline, said so, and both parts used one run id.
    assert "logging offline" in result.stderr
    states = [json.loads((checkpoints / f"checkpoint-{i}" / "trainer_state.json").read_text()) for i in (2, 4)]
    assert states[0]["wandb"]["id"] == states[1]["wandb"]["id"]
    assert states[0]["wandb"]["project"] == "comlrl-examples"
    offline_runs = sorted((workdir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(states[0]["wandb"]["id"]) for p in offline_runs)
    assert "env_step" in result.stdout and (workdir / "reward_curve.png").is_file()
