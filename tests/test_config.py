import dataclasses

from typing import Optional

import pytest

from comlrl import ConfigError, MAGRPOConfig
from comlrl.trainers.reinforce.config import RESUMABLE_FIELDS


def test_seed_fields_and_defaults():
    cfg = MAGRPOConfig(num_turns=1, num_train_epochs=2, num_generations=4, max_new_tokens=64, logging_steps=1)
    assert (cfg.num_train_epochs, cfg.num_generations, cfg.max_new_tokens, cfg.logging_steps) == (2, 4, 64, 1)
    assert cfg.seed == 42


# CoMLRL 1.4.3's MAGRPOConfig defaults: a 1.4.3 script trains the same here.
COMLRL_DEFAULTS = dict(
    num_train_epochs=20, agent_learning_rate=5e-6, logging_steps=50, num_agents=2, parallel_training="none",
    agent_devices=None, num_generations=4, max_new_tokens=256, temperature=0.6, top_p=0.6, top_k=50, num_turns=2,
    discount=1.0, joint_mode="aligned", early_termination_threshold=-0.2, external_prompt_passthrough=False,
    eval_interval=16, eval_num_samples=4, eval_batch_size=1, rollout_buffer_size=2, train_batch_size=2,
    advantage_normalization=True, advantage_mode="mean", reference_kl_enabled=False, reference_kl_coef=0.1,
    reference_devices=None)


def test_every_comlrl_field_exists_with_its_default():
    cfg = MAGRPOConfig()
    assert {name: getattr(cfg, name) for name in COMLRL_DEFAULTS} == COMLRL_DEFAULTS
    # AdamW as CoMLRL builds it (torch's defaults), no clipping, the dataset's own order.
    assert (cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2, cfg.max_grad_norm, cfg.shuffle) == \
        (0.01, 0.9, 0.999, None, False)
    assert MAGRPOConfig(rollout_buffer_size=8).train_batch_size == 8  # None follows the buffer


def test_a_none_default_follows_its_source_until_set():
    """train_batch_size=None is the buffer (and critic_learning_rate=None the agents' rate) whether
    the source is given at construction or assigned later, as CoMLRL resolves them at train time."""
    from comlrl.trainers.actor_critic import IACConfig

    cfg = MAGRPOConfig()
    cfg.rollout_buffer_size = 8
    assert cfg.train_batch_size == 8
    cfg.train_batch_size = 2  # its own value from now on
    cfg.rollout_buffer_size = 6
    assert cfg.train_batch_size == 2
    cfg.train_batch_size = None  # following again
    assert cfg.train_batch_size == 6
    cfg.rollout_buffer_size = 4
    assert (cfg.train_batch_size, cfg.to_dict()["train_batch_size"]) == (4, 4)
    with pytest.raises(ConfigError, match="rollout_buffer_size"):
        cfg.rollout_buffer_size = 0
    assert (cfg.rollout_buffer_size, cfg.train_batch_size) == (4, 4)  # a refused value changes nothing
    ac = IACConfig(critic_learning_rate=None)
    ac.agent_learning_rate = 1e-3
    assert ac.critic_learning_rate == 1e-3
    assert IACConfig().critic_learning_rate == 5e-6  # CoMLRL's default is a number: it stays
    assert IACConfig.DERIVED_DEFAULTS == {"train_batch_size": "rollout_buffer_size",
                                          "critic_learning_rate": "agent_learning_rate"}  # a subclass adds

    @dataclasses.dataclass
    class Mine(MAGRPOConfig):
        DERIVED_DEFAULTS = {"my_rate": "agent_learning_rate"}
        my_rate: Optional[float] = None

    mine = Mine(rollout_buffer_size=6)
    assert (mine.train_batch_size, mine.my_rate) == (6, mine.agent_learning_rate)


@pytest.mark.parametrize("options, words", [
    ({"parallel_training": "auto"}, "parallel_training"),
    ({"parallel_training": "mp"}, "agent_devices"),
    ({"num_agents": 0}, "num_agents"),
    ({"rollout_buffer_size": 0}, "rollout_buffer_size"),
    ({"eval_batch_size": 0}, "eval_batch_size"),
    ({"reference_kl_enabled": True, "reference_devices": ["cpu"] * 3}, "reference_devices length"),
])
def test_comlrl_constraints(options, words):
    with pytest.raises(ConfigError, match=words):
        MAGRPOConfig(**options)


def test_comlrl_spellings_are_normalised():
    assert MAGRPOConfig(parallel_training="MP", agent_devices="cpu").parallel_training == "mp"
    assert MAGRPOConfig(parallel_training=None).parallel_training == "none"
    assert MAGRPOConfig(joint_mode="align").joint_mode == "aligned"
    assert MAGRPOConfig(joint_mode="crossed").joint_mode == "cross"
    assert MAGRPOConfig(eval_num_samples=0).eval_num_samples == 0  # 0 or None: every eval prompt


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
    ("micro_batch_size", 0, "micro_batch_size"),
    ("max_grad_norm", 0.0, "max_grad_norm"),
    ("advantage_mode", "median", "advantage_mode"),
    ("joint_mode", "diagonal", "joint_mode"),
    ("loss_type", "ppo", "loss_type"),
    ("num_turns", 0, "num_turns"),
    ("discount", 1.5, "discount"),
    ("discount", -0.1, "discount"),
    ("early_termination_threshold", float("inf"), "early_termination_threshold"),
    ("seed", -1, "seed"),
    ("eval_interval", -1, "eval_interval"),
    ("eval_num_samples", -1, "eval_num_samples"),
    ("agent_devices", "gpu0", "agent_devices"),
    ("agent_devices", ["cpu", "tpu:x"], "agent_devices"),
    ("agent_devices", 3, "agent_devices"),
    ("nonfinite", "ignore", "nonfinite"),
    ("num_generations", True, "num_generations"),
])
def test_invalid_values_raise_at_construction(field, value, words):
    with pytest.raises(ConfigError, match=words):
        MAGRPOConfig(**{field: value})


def test_agent_devices_as_a_string_or_a_list():
    assert MAGRPOConfig(agent_devices="cpu").agent_devices == "cpu"
    assert MAGRPOConfig(agent_devices=("cpu", "cpu")).agent_devices == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match="did you mean 'agent_devices'"):
        MAGRPOConfig(device="cpu")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        MAGRPOConfig(top_p=2.0)


@pytest.mark.parametrize("name, suggestion", [
    ("learning_rate", "agent_learning_rate"),
    ("lr", "agent_learning_rate"),
    ("num_generation", "num_generations"),
    ("max_new_token", "max_new_tokens"),
    ("termination_threshold", "early_termination_threshold"),
    ("gradient_accumulation_steps", "micro_batch_size"),
])
def test_unknown_field_names_the_closest_real_one(name, suggestion):
    with pytest.raises(ConfigError, match=rf"no field '{name}'.*did you mean '{suggestion}'"):
        MAGRPOConfig(**{name: 1})


def test_assignment_is_checked_and_replace_revalidates():
    """CoMLRL's configs are mutable dataclasses; ours too, but every assignment is checked."""
    cfg = MAGRPOConfig()
    cfg.temperature = 0.5
    assert cfg.temperature == 0.5
    with pytest.raises(ConfigError, match="temperature"):
        cfg.temperature = 0
    assert cfg.temperature == 0.5
    with pytest.raises(ConfigError, match="did you mean 'num_generations'"):
        cfg.num_generation = 3
    assert dataclasses.replace(cfg, top_p=0.9).top_p == 0.9
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, temperature=0)


def test_every_field_is_documented_in_one_line():
    for f in dataclasses.fields(MAGRPOConfig):
        doc = f.metadata.get("doc")
        assert doc and "\n" not in doc, f.name


def test_only_the_documented_fields_may_change_on_resume():
    assert RESUMABLE_FIELDS == {"num_train_epochs", "logging_steps", "output_dir", "agent_devices", "parallel_training",
                                "reference_devices", "eval_interval", "eval_num_samples", "eval_batch_size",
                                "vllm_gpu_memory_utilization", "vllm_engine_kwargs", "report_to", "tensorboard_dir",
                                "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name", "tracker_failure",
                                "sharding", "sharding_group_size"}


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


def test_check_choice_normalises_aliases_and_none():
    from comlrl.engine.config import check_choice
    from comlrl.trainers.preference import MADPOIterConfig, MARLHFConfig

    check = check_choice("current", "model", aliases={"external": "model"}, none_is="current")
    assert [check("f", v) for v in (" Model ", "EXTERNAL", None, "")] == ["model", "model", "current", "current"]
    for bad in ("other", 3, {"a": 1}):
        with pytest.raises(ConfigError, match="f must be one of 'current', 'model'"):
            check("f", bad)
    with pytest.raises(ConfigError):
        check_choice("a", "b")("g", None)  # without none_is, None is not a choice
    assert MARLHFConfig(rl_algorithm=None).rl_algorithm == "magrpo"  # CoMLRL: None = the default
    cfg = MADPOIterConfig(comparator_policy="Endpoint", comparator_api_url="http://localhost:1/x",
                          comparator_generation_mode="centralised", preference_replay_mode=None)
    assert (cfg.comparator_policy, cfg.comparator_generation_mode, cfg.preference_replay_mode) == \
        ("api", "centralized", "current")
