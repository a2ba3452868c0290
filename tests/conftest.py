"""Shared fixtures: a tiny offline model, the seed's reward and prompts, a trainer factory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Tiny models: one intra-op thread is faster than two and immune to a busy second core
# (OpenMP threads spin-waiting on a loaded core made forwards 5-50x slower in our runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward  # noqa: E402


@pytest.fixture(scope="session")
def model_path():
    from comlrl.testing import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def make_trainer(model_path, tokenizer, tmp_path):
    """make_trainer(**config_overrides, trainer_kwargs...) -> MAGRPOTrainer on the seed task."""
    from transformers import AutoModelForCausalLM

    from comlrl import MAGRPOConfig, MAGRPOTrainer

    def factory(num_agents=2, reward_func=length_ratio_reward, dataset=None, trainer_kwargs=None, **overrides):
        settings = dict(TEST_SETTINGS, num_train_epochs=2, max_new_tokens=12, agent_learning_rate=1e-3,
                        output_dir=str(tmp_path / "out"))
        settings.update(overrides)
        return MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(num_agents)],
            tokenizer=tokenizer,
            reward_func=reward_func,
            train_dataset=dataset if dataset is not None else [{"prompt": p} for p in SEED_PROMPTS],
            args=MAGRPOConfig(**settings),
            **(trainer_kwargs or {}),
        )

    return factory


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh: ``--dist loadgroup``) the sandbox's tests share one worker:
    they bound programs by wall-clock timeouts and start process pools of their own, so they run one
    at a time beside the rest of the suite rather than beside each other. Slow tests (minutes each:
    learning, kill -9, subprocess runs) go first, in their own order, so that no worker starts one
    when the others are done; the rest keep theirs."""
    for item in items:
        if item.path.name.startswith("test_sandbox"):
            item.add_marker(pytest.mark.xdist_group("sandbox"))
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is None)
