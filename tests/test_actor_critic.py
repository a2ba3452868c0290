"""The actor-critic family (IAC, MAAC): construction rules, batched values, per-agent rewards,
resume, evaluation, export, LoRA critics and task-metric callbacks."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl import ConfigError, ResumeMismatchError
from comlrl.models.actor_critic import CausalLMWithValueHead
from comlrl.trainers import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl.trainers.actor_critic import RolloutSample

from helpers import SEED_PROMPTS, assert_bit_exact, length_ratio_reward, play, rows, state_of

AC_SETTINGS = dict(num_turns=1, num_generations=2, num_train_epochs=2, max_new_tokens=10, rollout_buffer_size=4,
                   train_batch_size=2, agent_learning_rate=1e-3, critic_learning_rate=1e-3, eval_interval=0,
                   temperature=1.0, top_p=1.0, top_k=50, weight_decay=0.0, max_grad_norm=1.0, shuffle=True,
                   early_termination_threshold=None)


@pytest.fixture
def make_ac(model_path, tokenizer, tmp_path):
    """make_ac("iac" | "iac-shared" | "maac", **config_overrides) on the seed task."""

    def factory(kind="iac", reward_func=length_ratio_reward, trainer_kwargs=None, **overrides):
        settings = dict(AC_SETTINGS, output_dir=str(tmp_path / "out"))
        settings.update(overrides)
        agents = [AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)]
        kwargs = dict(agents=agents, tokenizer=tokenizer, reward_func=reward_func,
                      train_dataset=[{"prompt": p} for p in SEED_PROMPTS], **(trainer_kwargs or {}))
        if kind == "maac":
            return MAACTrainer(critic_model=model_path, args=MAACConfig(**settings), **kwargs)
        if kind == "iac-shared":
            return IACTrainer(args=IACConfig(use_separate_critic=False, **settings), **kwargs)
        return IACTrainer(critic_model=model_path, args=IACConfig(**settings), **kwargs)

    return factory


STUB = SimpleNamespace(pad_token="<pad>", eos_token="</s>", pad_token_id=0, eos_token_id=1)


def _tiny(vocab=32, width=16):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=width, n_layer=1, n_head=1))


def _zero(*completions, **kwargs):
    return [0.0] * len(completions[0])


# --- configs ----------------------------------------------------------------------------------

def test_config_defaults_are_comlrl_143s():
    iac, maac = IACConfig(), MAACConfig()
    for cfg in (iac, maac):
        assert (cfg.agent_learning_rate, cfg.critic_learning_rate, cfg.rollout_buffer_size, cfg.train_batch_size,
                cfg.value_loss_coef, cfg.advantage_normalization, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                cfg.top_k, cfg.num_train_epochs, cfg.num_agents, cfg.num_turns, cfg.num_generations,
                cfg.parallel_training, cfg.discount, cfg.critic_type, cfg.early_termination_threshold,
                cfg.eval_interval, cfg.eval_num_samples, cfg.eval_batch_size, cfg.logging_steps,
                cfg.reference_kl_enabled, cfg.reference_kl_coef) == (
            5e-6, 5e-6, 8, 8, 0.6, True, 256, 0.6, 0.6, None, 40, 2, 2, 1, "none", 1.0, "v", -0.2, 16, 4, 1, 1,
            False, 0.1)
    assert (iac.value_clip_range, iac.use_separate_critic, iac.value_head_hidden_dim,
            iac.critic_value_head_hidden_dim) == (0.2, True, None, None)


@pytest.mark.parametrize("cls", [IACConfig, MAACConfig])
@pytest.mark.parametrize("field, value", [("rollout_buffer_size", 0), ("train_batch_size", 0), ("num_agents", 0),
                                          ("num_generations", 0), ("num_turns", 0), ("eval_batch_size", 0),
                                          ("logging_steps", 0), ("eval_interval", -1), ("eval_num_samples", -1),
                                          ("critic_type", "x"), ("parallel_training", "auto")])
def test_config_names_the_bad_field(cls, field, value):
    with pytest.raises(ConfigError, match=field):
        cls(**{field: value})


@pytest.mark.parametrize("cls", [IACConfig, MAACConfig])
def test_config_cross_field_rules(cls):
    with pytest.raises(ConfigError, match="num_generations=1"):
        cls(num_turns=2, num_generations=2)
    with pytest.raises(ConfigError, match="agent_devices"):
        cls(parallel_training="mp", critic_devices="cpu")
    with pytest.raises(ConfigError, match="critic_devices"):
        cls(parallel_training="mp", agent_devices="cpu")
    cls(parallel_training="mp", agent_devices="cpu", critic_devices="cpu")
    assert cls(critic_type="Q").critic_type == "q"
    assert cls(critic_learning_rate=None, agent_learning_rate=2e-5).critic_learning_rate == 2e-5
    IACConfig(parallel_training="mp", agent_devices="cpu", use_separate_critic=False)  # no critic, no devices


# --- construction -----------------------------------------------------------------------------

def test_argument_errors_come_before_any_model_is_touched():
    with pytest.raises(ConfigError, match="reward_func"):
        IACTrainer(agent_model="no/such/model", reward_func=None)
    with pytest.raises(ConfigError, match="Either agent_model or agents"):
        MAACTrainer(reward_func=_zero)
    with pytest.raises(ConfigError, match="use_separate_critic"):
        IACTrainer(agent_model="no/such/model", critics=[object()], reward_func=_zero,
                   args=IACConfig(use_separate_critic=False))
    for cls in (IACTrainer, MAACTrainer):  # the transition is named before the missing critics
        with pytest.raises(ConfigError, match="external_transition"):
            cls(agents=[object()], tokenizer=STUB, reward_func=_zero,
                args=cls.config_class(num_agents=1, num_turns=2))
    with pytest.raises(ConfigError, match="critics must be provided"):
        IACTrainer(agents=[object()], tokenizer=STUB, reward_func=_zero, args=IACConfig(num_agents=1, num_turns=1))
    with pytest.raises(ConfigError, match="critics length"):
        IACTrainer(agents=[object(), object()], critics=[object()], tokenizer=STUB, reward_func=_zero,
                   args=IACConfig(num_turns=1))
    with pytest.raises(ConfigError, match="critics length"):
        MAACTrainer(agents=[object()], critics=[object(), object()], tokenizer=STUB, reward_func=_zero,
                    args=MAACConfig(num_agents=1, num_turns=1))
    with pytest.raises(ConfigError, match="critic_model or critics must be provided for MAAC"):
        MAACTrainer(agents=[object()], tokenizer=STUB, reward_func=_zero, args=MAACConfig(num_agents=1, num_turns=1))


def test_iac_shared_heads_and_separate_critics():
    a = _tiny()
    shared = IACTrainer(agents=[a, a], tokenizer=STUB, reward_func=_zero,
                        args=IACConfig(num_turns=1, use_separate_critic=False, value_head_hidden_dim=8))
    assert shared.critics == [] and shared.critic_optimizers == []
    assert all(m.value_head is not None and m.value_head.hidden_dim == 8 for m in shared.agents)
    # One object for both agents: each gets its own weights (two optimizers never step one tensor).
    assert shared.agents[0].model is not shared.agents[1].model
    separate = IACTrainer(agents=[a, _tiny(48, 24)], critics=[_tiny(48, 24), a], tokenizer=[STUB, STUB],
                          reward_func=_zero, args=IACConfig(num_turns=1))
    assert len(separate.critics) == 2 and len(separate.critic_optimizers) == 2
    assert all(m.value_head is None for m in separate.agents)
    assert separate.critics[1].model is not separate.agents[0].model  # the actor object reused as a critic: a copy
    params = [id(p) for m in separate.agents + separate.critics for p in m.parameters()]
    assert len(params) == len(set(params))


def test_given_value_head_models_keep_their_heads():
    wrapped = CausalLMWithValueHead(_tiny(), value_head_hidden_dim=4)
    trainer = IACTrainer(agents=[wrapped], tokenizer=STUB, reward_func=_zero,
                         args=IACConfig(num_agents=1, num_turns=1, use_separate_critic=False))
    assert trainer.agents[0].value_head is wrapped.value_head
    maac = MAACTrainer(agents=[_tiny()], critics=[CausalLMWithValueHead(_tiny(), 6)], tokenizer=STUB,
                       reward_func=_zero, args=MAACConfig(num_agents=1, num_turns=1))
    assert maac.critics[0].value_head.hidden_dim == 6 and maac.critic_optimizer is maac.critic_optimizers[0]


def test_critic_with_a_smaller_vocabulary_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="embedding has only 32 rows"):
        IACTrainer(agents=[_tiny(len(tokenizer))], critics=[_tiny(32)], tokenizer=tokenizer, reward_func=_zero,
                   args=IACConfig(num_agents=1, num_turns=1))


def test_reference_models_are_plain_frozen_copies(model_path, tokenizer):
    trainer = IACTrainer(agent_model=model_path, tokenizer=tokenizer, reward_func=_zero,
                         args=IACConfig(num_agents=1, num_turns=1, use_separate_critic=False,
                                        reference_kl_enabled=True))
    ref = trainer.reference_models[0]
    assert type(ref).__name__ == "Qwen2ForCausalLM" and ref is not trainer.agents[0].model
    assert not any(p.requires_grad for p in ref.parameters())


# --- values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, critic_type", [("iac", "v"), ("iac", "q"), ("iac-shared", "v"),
                                               ("iac-shared", "q"), ("maac", "v"), ("maac", "q")])
def test_batched_values_equal_one_at_a_time(make_ac, kind, critic_type):
    from comlrl.engine.step import select_rows

    trainer = make_ac(kind, critic_type=critic_type, num_generations=2)
    turn = play(trainer, [0, 1, 2])[0]
    with torch.no_grad():
        batched, extra = trainer._turn_values(turn)
        for a, ro in enumerate(turn.rollouts):
            for r in range(len(ro.texts)):
                if kind == "maac":
                    one = trainer._critic_values(select_rows(extra["critic_inputs"], torch.tensor([r])))
                else:
                    one = trainer._values(a, select_rows(ro, torch.tensor([r])))
                assert one.item() == pytest.approx(batched[a][r].item(), abs=1e-5)


@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_shared_head_update_reads_the_same_value_as_the_rollout(make_ac, critic_type):
    """With a value head on the agent, the update takes the value from the policy's own forward
    pass; it equals the separate value forward of the rollout phase."""
    from comlrl.functional.logprobs import log_probs_and_hidden
    from comlrl.trainers.actor_critic.ac_base import head_values, value_positions

    trainer = make_ac("iac-shared", critic_type=critic_type)
    turn = play(trainer, [0, 1])[0]
    ro, actor = turn.rollouts[0], trainer.agents[0]
    with torch.no_grad():
        alone = trainer._values(0, ro)
        _, hidden = log_probs_and_hidden(actor.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, 1.0)
        together = head_values(actor, hidden, value_positions(ro, critic_type))
    assert torch.allclose(alone, together, atol=1e-5)


def test_maac_critic_text_layout():
    from comlrl.trainers.actor_critic.maac import joint_critic_text

    assert joint_critic_text(["p0", "p1"]) == "[Agent 0] p0\n\n[Agent 1] p1"
    assert joint_critic_text(["p0", "p1"], ["a0", "a1"]) == (
        "[Agent 0] p0\n\n[Agent 1] p1\n\n[Joint Action]\n\n[Agent 0 action]\na0\n\n[Agent 1 action]\na1")


def test_td_targets_and_advantages_of_a_buffer(make_ac):
    trainer = make_ac("iac", advantage_normalization=False)
    turns = play(trainer, [0, 1])
    data = trainer._advantages(turns)
    for a in range(2):
        values, targets = data.values[a][0], data.targets[a][0]
        assert torch.equal(targets, turns[0].rewards)  # one turn: the target is the reward
        assert torch.allclose(data.advantages[a][0].double(), targets - values, atol=1e-6)
    normalized = make_ac("iac")._advantages(turns).advantages[0][0]
    assert abs(float(normalized.mean())) < 1e-5 and float(normalized.std(unbiased=False)) == pytest.approx(1, abs=1e-4)


def test_per_agent_rewards_give_each_agent_its_target(make_ac):
    def own(completions1, completions2):
        return [[1.0] * len(completions1), [-1.0] * len(completions2)]  # agent 0 always +1, agent 1 always -1

    trainer = make_ac("iac", reward_func=own, advantage_normalization=False)
    turns = play(trainer, [0])
    data = trainer._advantages(turns)
    assert data.targets[0][0].tolist() == [1.0, 1.0] and data.targets[1][0].tolist() == [-1.0, -1.0]
    assert turns[0].rewards.tolist() == [0.0, 0.0]  # the joint reward is their mean

    def one_each(completions1, completions2):  # N values with J=1: one reward per agent (CoMLRL's form)
        return [0.5, -0.5]

    single = make_ac("iac", reward_func=one_each, num_generations=1, rollout_buffer_size=2)
    data = single._advantages(play(single, [0]))
    assert data.targets[0][0].tolist() == [0.5] and data.targets[1][0].tolist() == [-0.5]


# --- training ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["iac", "iac-shared", "maac"])
def test_train_steps_every_module(make_ac, kind):
    trainer = make_ac(kind, reference_kl_enabled=True, reference_kl_coef=0.05)
    before = {k: v.clone() for k, v in state_of(trainer).items() if ".param." in k}
    trainer.train()
    after = state_of(trainer)
    for slot in trainer.trained_slots().modules:
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(slot + ".")), slot
    assert any(torch.count_nonzero(v) for k, v in after.items() if ".opt." in k and k.endswith("exp_avg"))
    for ref in trainer.reference_models:
        assert not any(p.requires_grad for p in ref.parameters())
    logged = rows(trainer.args.output_dir)
    assert logged[-1]["env_step"] == 16 and logged[-1]["global_step"] == 8  # 2 epochs x 2 buffers x 2 steps
    assert "agent_0/reference_kl" in logged[-1] and "agent_1/value_mean" in logged[-1]
    assert ("critic/value_loss" if kind == "maac" else "agent_0/value_loss") in logged[-1]


@pytest.mark.parametrize("kind", ["iac", "iac-shared", "maac"])
def test_resume_equals_uninterrupted_bit_exact(make_ac, kind, tmp_path):
    full = make_ac(kind, num_train_epochs=3, output_dir=str(tmp_path / "f"))
    full.train(checkpoint_dir=tmp_path / "full")
    part = make_ac(kind, num_train_epochs=3)
    part.train(checkpoint_dir=tmp_path / "part", save_steps=1)
    cut = tmp_path / "part" / "checkpoint-3"  # mid-epoch: epoch 1, after its first buffer... of 2 steps
    with pytest.raises(ResumeMismatchError, match="value_loss_coef"):  # the strict resume diff names the change
        make_ac(kind, num_train_epochs=3, value_loss_coef=0.5).train(resume_from_checkpoint=cut)
    resumed = make_ac(kind, num_train_epochs=3)
    resumed.train(resume_from_checkpoint=cut, checkpoint_dir=tmp_path / "part", save_steps=1)
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")
    files = {p.relative_to(cut).as_posix() for p in cut.rglob("*") if p.is_file()}
    critic_slots = {"critic-0"} if kind == "maac" else ({"critic-0", "critic-1"} if kind == "iac" else set())
    assert {f.split("/")[0] for f in files if "/" in f} == {"agent-0", "agent-1"} | critic_slots
    assert not any(f.endswith((".pt", ".pkl", ".bin")) for f in files)


def test_evaluation_leaves_training_unchanged(make_ac, tmp_path):
    plain = make_ac("maac")
    plain.train()
    evaluated = make_ac("maac", eval_interval=2, trainer_kwargs={"eval_dataset": [{"prompt": p} for p in SEED_PROMPTS]})
    evaluated.train()
    assert_bit_exact(state_of(plain), state_of(evaluated))
    metrics = evaluated.evaluate()
    assert {"eval/turn_1/reward_mean", "eval/reward_mean"} <= set(metrics)


def test_metrics_callback_sees_rollout_samples(make_ac):
    seen = []

    def callback(samples):
        seen.append(samples)
        return {"mean_length": sum(s.response_len for s in samples) / len(samples), "note": "text is skipped"}

    eval_rows = [{"prompt": p} for p in SEED_PROMPTS[:2]]
    trainer = make_ac("iac", num_train_epochs=1, trainer_kwargs={"metrics_callback": callback,
                                                                 "eval_dataset": eval_rows})
    trainer.train()
    samples = seen[0]
    assert all(isinstance(s, RolloutSample) for s in samples) and len(samples) == 4  # 2 agents x K=2
    s = samples[0]
    assert s.full_input_ids.shape == (s.prompt_len + s.response_len,) and s.metadata["turn_idx"] == 0
    assert s.metadata["batch_item"]["prompt"] in SEED_PROMPTS and torch.isfinite(s.old_value).all()
    assert "mean_length" in rows(trainer.args.output_dir)[-1] and "note" not in rows(trainer.args.output_dir)[-1]
    assert "eval/mean_length" in trainer.evaluate()


def test_save_model_writes_loadable_actors_and_critics(make_ac, tmp_path):
    for kind, critic_dirs in (("iac", ["agent_0/critic", "agent_1/critic"]), ("iac-shared", []),
                              ("maac", ["critic"])):
        trainer = make_ac(kind, num_train_epochs=1)
        out = trainer.save_model(tmp_path / kind)
        actor = AutoModelForCausalLM.from_pretrained(out / "agent_0")
        assert torch.equal(actor.lm_head.weight, trainer.agents[0].model.lm_head.weight)
        assert (out / "agent_0" / "value_head.safetensors").exists() == (kind == "iac-shared")
        for folder in critic_dirs:
            critic = CausalLMWithValueHead.from_pretrained(out / folder)
            source = trainer.critics[critic_dirs.index(folder)]
            assert torch.equal(critic.value_head.value_projection.weight, source.value_head.value_projection.weight)


def test_lora_agents_and_critics_share_one_base(model_path, tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")

    def build(**overrides):
        return IACTrainer(agent_model=model_path, tokenizer=tokenizer, reward_func=length_ratio_reward,
                          train_dataset=[{"prompt": p} for p in SEED_PROMPTS], peft_config=lora,
                          args=IACConfig(**{**AC_SETTINGS, "output_dir": str(tmp_path / "o"), **overrides}))

    trainer = build(num_train_epochs=2)
    bases = {id(m.model.shared) for m in trainer.agents} | {id(c.model.shared) for c in trainer.critics}
    assert len(bases) == 1 and trainer.critics[0].model.adapter_name == "critic_0"
    trainer.train(checkpoint_dir=tmp_path / "full")
    part = build(num_train_epochs=1)
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = build(num_train_epochs=2)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-1", checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(trainer), state_of(resumed))


def test_multi_turn_targets_bootstrap_from_the_next_turn(make_ac):
    def transition(prompt, agent_completions, num_agents):
        return [f"{prompt} again" for _ in range(num_agents)]

    trainer = make_ac("maac", num_turns=2, num_generations=1, discount=0.5, advantage_normalization=False,
                      trainer_kwargs={"external_transition": transition})
    turns = play(trainer, [0, 1])
    assert len(turns) == 2
    data = trainer._advantages(turns)
    for a in range(2):
        expected = turns[0].rewards + 0.5 * data.values[a][1]
        assert torch.allclose(data.targets[a][0], expected) and torch.equal(data.targets[a][1], turns[1].rewards)
    trainer.train()
    assert {"turn_1/reward_mean", "turn_2/reward_mean"} <= set(rows(trainer.args.output_dir)[-1])


def test_metrics_file_is_strict_json(make_ac):
    trainer = make_ac("iac", num_train_epochs=1)
    trainer.train()
    for line in open(f"{trainer.args.output_dir}/metrics.jsonl"):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_a_comlrl_143_actor_critic_checkpoint_is_refused_not_half_loaded(make_ac, tmp_path):
    from comlrl import CheckpointError

    legacy = tmp_path / "checkpoint-1"
    legacy.mkdir()
    (legacy / "training_state.pt").write_bytes(b"\x00")  # 1.4.3's file name; never read
    trainer = make_ac("iac")
    before = state_of(trainer)
    with pytest.raises(CheckpointError, match="1.4.3 IACTrainer run .* is not supported"):
        trainer.train(resume_from_checkpoint=legacy)
    assert_bit_exact(before, state_of(trainer))


@pytest.mark.parametrize("kind", ["iac-shared", "maac"])
def test_bf16_actor_critic_samples_on_copies_of_its_policies(make_ac, kind):
    """mixed_precision="bf16" for the actor-critic families: each policy (also one that carries the
    critic's value head) samples on a bf16 copy that follows its float32 weights."""
    trainer = make_ac(kind, num_train_epochs=1, mixed_precision="bf16")
    trainer.train()
    for policy, copy in zip(trainer._policies(), trainer.backend.copies):
        assert copy is not None and copy.refreshes >= 1
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        copy.refresh()
        assert all(torch.equal(c, p.detach().to(torch.bfloat16))
                   for c, p in zip(copy.module.parameters(), policy.parameters()))
