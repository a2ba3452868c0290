"""A run started with CoMLRL 1.4.3 continues here: tests/fixtures/comlrl143 holds a 1.4.3 checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl import ResumeMismatchError
from comlrl.checkpoint.legacy import read_legacy_checkpoint
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer, MARLOOTrainer
from comlrl.utils import read_checkpoint_metadata

FIXTURE = Path(__file__).parent / "fixtures" / "comlrl143"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def reward(agent0, agent1):
    """The fixture's reward (expected.json: reward.expression)."""
    return [(len(a.split()) - len(b.split())) / 4.0 for a, b in zip(agent0, agent1)]


def build(cls=MAGRPOTrainer, **changes):
    model = FIXTURE / "model"
    args = {**EXPECTED["args"], "num_train_epochs": 3, **changes}
    return cls(agents=[AutoModelForCausalLM.from_pretrained(model) for _ in range(2)],
               tokenizer=AutoTokenizer.from_pretrained(model), reward_func=reward,
               train_dataset=Dataset.from_list([{"prompt": p} for p in EXPECTED["prompts"]]),
               args=MAGRPOConfig(**args))


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", target)
    return target


def test_a_comlrl143_run_continues_here(run_dir):
    trainer = build()
    trainer.train(resume_from_checkpoint=run_dir / "checkpoint-2", checkpoint_dir=run_dir)
    assert trainer.state.epoch == 3 and trainer.run_id == EXPECTED["run_id"]
    # One more epoch: 3 prompts x 2 generations scored, 2 more optimizer steps (buffer of 2, then 1).
    assert trainer.env_step == EXPECTED["env_step"] + 6 and trainer.state.global_step == 4 + 2
    meta = read_checkpoint_metadata(run_dir / "checkpoint-3")
    assert meta["run_id"] == EXPECTED["run_id"] and meta["epoch"] == 3 and meta["env_step"] == 18
    assert (run_dir / "checkpoint-3" / "manifest.json").is_file()  # written in comlrl's own format


def test_the_loaded_state_is_the_checkpoints(run_dir):
    trainer = build(num_train_epochs=2)  # nothing left to train: load only
    assert trainer.train(resume_from_checkpoint=run_dir / "checkpoint-2") == {}
    saved = read_legacy_checkpoint(run_dir / "checkpoint-2")
    for agent, state in zip(trainer.agents, saved.agent_states):
        for name, tensor in agent.state_dict().items():
            assert torch.equal(tensor, state[name]), name
    for optimizer, state in zip(trainer.optimizers, saved.optimizer_states):
        moments = optimizer.state_dict()["state"]
        assert all(torch.equal(moments[i]["exp_avg"], state["state"][i]["exp_avg"]) for i in state["state"])
        assert optimizer.param_groups[0]["weight_decay"] == 0.01  # 1.4.3's AdamW settings come along
    assert (trainer.state.epoch, trainer.env_step) == (2, EXPECTED["env_step"])


@pytest.mark.parametrize("changes, named", [
    ({"temperature": 0.9}, "config.temperature"),
    ({"num_generations": 4}, "config.num_generations"),
])
def test_a_changed_setting_is_refused_by_name(run_dir, changes, named):
    with pytest.raises(ResumeMismatchError, match=named.replace(".", r"\.")):
        build(**changes).train(resume_from_checkpoint=run_dir / "checkpoint-2")


def test_another_trainer_class_is_refused(run_dir):
    with pytest.raises(ResumeMismatchError, match="trainer: saved MAGRPOTrainer, now MARLOOTrainer"):
        build(MARLOOTrainer).train(resume_from_checkpoint=run_dir / "checkpoint-2")


def test_other_data_is_refused(run_dir):
    trainer = build()
    trainer.train_dataset = Dataset.from_list([{"prompt": p} for p in EXPECTED["prompts"] + ["i j"]])
    with pytest.raises(ResumeMismatchError, match="dataset: saved 3 rows, now 4"):
        trainer.train(resume_from_checkpoint=run_dir / "checkpoint-2")
