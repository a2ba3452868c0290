import dataclasses

import pytest

from comlrl import ConfigError, MAGRPOConfig
from comlrl.trainers.reinforce.config import RESUMABLE_FIELDS


def test_seed_fields_and_defaults():
    cfg = MAGRPOConfig(num_turns=1, num_train_epochs=2, num_generations=4, max_new_tokens=64, logging_steps=1)
    assert (cfg.num_train_epochs, cfg.num_generations, cfg.max_new_tokens, cfg.logging_steps) == (2, 4, 64, 1)
    assert cfg.seed == 42 and cfg.temperature == 1.0 and cfg.top_p == 1.0 and cfg.top_k == 50


@pytest.mark.parametrize("field, value, words", [
    ("num_generations", 1, "num_generations"),
    ("num_generations", 0, "num_generations"),
    ("max_new_tokens", -5, "max_new_tokens"),
    ("max_new_tokens", 0, "max_new_tokens"),
    ("temperature", 0.0, "temperature"),
    ("temperature", -1.0, "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k"),
    ("num_train_epochs", 0, "num_train_epochs"),
    ("logging_steps", 0, "logging_steps"),
    ("agent_learning_rate", 0.0, "agent_learning_rate"),
    ("agent_learning_rate", "1e-3", "agent_learning_rate"),
    ("train_batch_size", 0, "train_batch_size"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps"),
    ("max_grad_norm", 0.0, "max_grad_norm"),
    ("advantage_mode", "median", "advantage_mode"),
    ("joint_mode", "diagonal", "joint_mode"),
    ("loss_type", "ppo", "loss_type"),
    ("num_turns", 0, "num_turns"),
    ("discount", 1.5, "discount"),
    ("discount", -0.1, "discount"),
    ("termination_threshold", float("inf"), "termination_threshold"),
    ("seed", -1, "seed"),
    ("eval_interval", -1, "eval_interval"),
    ("eval_num_samples", 0, "eval_num_samples"),
    ("device", "gpu0", "device"),
    ("agent_devices", "cuda:0", "agent_devices"),
    ("agent_devices", ["cpu", "tpu:x"], "agent_devices"),
    ("num_generations", True, "num_generations"),
])
def test_invalid_values_raise_at_construction(field, value, words):
    with pytest.raises(ConfigError, match=words):
        MAGRPOConfig(**{field: value})


def test_agent_devices_normalised_and_exclusive_with_device():
    assert MAGRPOConfig(agent_devices=["cpu", "cpu"]).agent_devices == ("cpu", "cpu")
    with pytest.raises(ConfigError, match="either device .* or agent_devices"):
        MAGRPOConfig(device="cpu", agent_devices=["cpu", "cpu"])


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        MAGRPOConfig(top_p=2.0)


@pytest.mark.parametrize("name, suggestion", [
    ("learning_rate", "agent_learning_rate"),
    ("lr", "agent_learning_rate"),
    ("num_generation", "num_generations"),
    ("max_new_token", "max_new_tokens"),
])
def test_unknown_field_names_the_closest_real_one(name, suggestion):
    with pytest.raises(ConfigError, match=rf"no field '{name}'.*did you mean '{suggestion}'"):
        MAGRPOConfig(**{name: 1})


def test_config_is_frozen_and_replace_revalidates():
    cfg = MAGRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 0.5  # type: ignore[misc]
    assert dataclasses.replace(cfg, temperature=0.5).temperature == 0.5
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, temperature=0)


def test_every_field_is_documented_in_one_line():
    for f in dataclasses.fields(MAGRPOConfig):
        doc = f.metadata.get("doc")
        assert doc and "\n" not in doc, f.name


def test_only_the_documented_fields_may_change_on_resume():
    assert RESUMABLE_FIELDS == {"num_train_epochs", "logging_steps", "output_dir", "device", "agent_devices",
                                "eval_interval", "eval_num_samples", "vllm_gpu_memory_utilization",
                                "vllm_engine_kwargs"}


def test_round_trip_through_dict():
    cfg = MAGRPOConfig(top_k=5, temperature=0.7)
    assert MAGRPOConfig.from_dict(cfg.to_dict()) == cfg


def test_named_variants_fix_the_baseline():
    from comlrl.trainers.reinforce import MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig

    assert MAREINFORCEConfig().advantage_mode == "raw"
    assert MARLOOConfig(num_generations=3).advantage_mode == "rloo"
    assert MAReMaxConfig().advantage_mode == "max"
    assert isinstance(MARLOOConfig(), MAGRPOConfig)
    with pytest.raises(ConfigError, match="MARLOOConfig has no field 'lr'"):
        MARLOOConfig(lr=1e-3)
    with pytest.raises(ConfigError, match="num_generations"):
        MAReMaxConfig(num_generations=1)
