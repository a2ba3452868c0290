"""The preference family: pair selection and losses against slow references, the reward model,
MADPO / MARLHF / iterative runs and their exact resume at every phase, replay, plots, comparators
(a model, the policy's history, a real HTTP endpoint), secrets kept out of every file."""

import json
import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl import ConfigError
from comlrl.functional.preference import (bradley_terry_loss, dpo_logits, lambda_decay_weights, multi_agent_dpo_loss,
                                          replay_draws, reward_histogram, select_comparison_pairs, select_pairs)
from comlrl.trainers.preference import (JointRewardModel, MADPOConfig, MADPOIterConfig, MADPOIterTrainer,
                                        MADPOTrainer, MARLHFConfig, MARLHFIterConfig, MARLHFIterTrainer,
                                        MARLHFTrainer)
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata, set_reward_range

from helpers import (SEED_PROMPTS, assert_bit_exact, assert_same_gradients, length_ratio_reward, record_gradients,
                     rows, state_of)

PREF = dict(num_train_epochs=2, preference_num_candidates=4, preference_pairs_per_sample=2, max_new_tokens=10,
            agent_learning_rate=1e-3, temperature=1.0, top_p=1.0, train_batch_size=2, eval_interval=0, logging_steps=1,
            weight_decay=0.0, max_grad_norm=1.0)
RLHF = dict(reward_model_device="cpu", num_generations=2, reward_train_batch_size=4, reward_num_train_epochs=1,
            reward_learning_rate=1e-3, rollout_buffer_size=2)
ITER = dict(num_iterations=2, num_train_epochs=1)


def _reward(completions1, completions2):
    return length_ratio_reward(completions1, completions2)


set_reward_range(_reward, 0.0, 1.0)


@pytest.fixture
def make(model_path, tokenizer, tmp_path):
    """make(cls, **config) on the seed task: agents loaded from the tiny model's directory."""
    configs = {MADPOTrainer: MADPOConfig, MARLHFTrainer: MARLHFConfig, MADPOIterTrainer: MADPOIterConfig,
               MARLHFIterTrainer: MARLHFIterConfig}

    def factory(cls, trainer_kwargs=None, **overrides):
        settings = dict(PREF, output_dir=str(tmp_path / "out"))
        if cls in (MARLHFTrainer, MARLHFIterTrainer):
            settings.update(RLHF)
        if cls in (MADPOIterTrainer, MARLHFIterTrainer):
            settings.update(ITER)
        settings.update(overrides)
        return cls(agent_model=str(model_path), tokenizer=tokenizer, reward_func=_reward,
                   train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=configs[cls](**settings),
                   **(trainer_kwargs or {}))

    return factory


# --- pure functions against slow references -------------------------------------------------------

@pytest.mark.parametrize("mode", ["reward_gap", "all", "random"])
def test_select_pairs_matches_the_reference(mode):
    rng = random.Random(0)
    for _ in range(30):
        rewards = [rng.choice([0.0, 0.5, 1.0, 0.25]) for _ in range(rng.randint(1, 6))]
        limit = rng.choice([None, 1, 3])
        got = select_pairs(rewards, mode, limit, np.random.default_rng(1))
        every = [(i, j) for i in range(len(rewards)) for j in range(len(rewards)) if rewards[i] > rewards[j]]
        assert sorted(got) == sorted(got) and set(got) <= set(every)
        assert all(rewards[w] > rewards[lo] for w, lo in got)  # ties never pair
        if mode == "all" or limit is None:
            assert sorted(got) == sorted(every)
        else:
            assert len(got) == min(limit, len(every))
        if mode == "reward_gap" and got:
            gaps = [rewards[w] - rewards[lo] for w, lo in got]
            assert gaps == sorted(gaps, reverse=True)
            assert min(gaps) >= max((rewards[w] - rewards[lo] for w, lo in every if (w, lo) not in got), default=0)


def test_select_comparison_pairs():
    current, comparator = [0.9, 0.2, 0.5, 0.4], [0.1, 0.8, 0.5, 0.6]
    assert select_comparison_pairs(current, comparator, "all", None) == [("current", 0), ("comparator", 1),
                                                                         ("comparator", 3)]
    assert select_comparison_pairs(current, comparator, "reward_gap", 2) == [("current", 0), ("comparator", 1)]
    assert select_comparison_pairs(current, comparator, "comparator_reward", 1) == [("comparator", 1)]


def test_multi_agent_dpo_loss_gradients_against_the_reference():
    """Each agent's gradient is that of -log sigmoid(sum of all margins), through its own margin only."""
    gen = torch.Generator().manual_seed(0)
    logp = [[torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)]
            for _ in range(3)]  # agent x (chosen, rejected)
    ref = [[torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(3)]
    beta = 0.3
    margins = [dpo_logits(c, r, rc, rr, beta) for (c, r), (rc, rr) in zip(logp, ref)]
    for a in range(3):
        partners = sum(m.detach() for i, m in enumerate(margins) if i != a)
        loss = multi_agent_dpo_loss(margins[a], partners)
        grads = torch.autograd.grad(loss, logp[a])
        # reference: d/d chosen of mean(-log sigmoid(z)) = -(1 - sigmoid(z)) * beta / P
        z = sum(beta * ((c - r) - (rc - rr)) for (c, r), (rc, rr) in zip(
            [(x.detach(), y.detach()) for x, y in logp], ref))
        expected = -(1 - torch.sigmoid(z)) * beta / 5
        assert torch.allclose(grads[0], expected) and torch.allclose(grads[1], -expected)
        assert loss.item() == pytest.approx(float(-torch.nn.functional.logsigmoid(z).mean()))


def test_bradley_terry_loss_and_replay_weights():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0))) / 2
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected)
    assert lambda_decay_weights(3, 1.0) == pytest.approx([1 / 3] * 3)
    assert lambda_decay_weights(3, 0.0) == pytest.approx([0.0, 0.0, 1.0])
    w = lambda_decay_weights(3, 0.5)
    assert w == pytest.approx([0.25 / 1.75, 0.5 / 1.75, 1 / 1.75])
    draws = replay_draws([3, 0, 2], [1.0, 1.0, 1.0], 10, np.random.default_rng(0))
    assert len(draws) == 10 and all(s != 1 for s, _ in draws)
    firsts = [i for s, i in draws if s == 0][:3]
    assert len(firsts) < 3 or sorted(firsts) == [0, 1, 2]  # a shard's pairs all come before any repeats
    assert reward_histogram([0.0, 0.5, 1.0, 7.0, float("nan")], 0.0, 1.0, bins=4)[0] == [1, 0, 1, 2]


def test_joint_reward_model_pools_the_last_real_token(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    backbone = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=1)).eval()
    model = JointRewardModel(backbone)
    ids = torch.tensor([[5, 6, 7]])
    alone = model(ids, torch.ones_like(ids))
    left = model(torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]]))
    right = model(torch.tensor([[5, 6, 7, 0, 0]]), torch.tensor([[1, 1, 1, 0, 0]]))
    assert torch.allclose(alone, left, atol=1e-5) and torch.allclose(alone, right, atol=1e-5)
    with pytest.raises(ConfigError, match="hidden size"):
        JointRewardModel(torch.nn.Linear(2, 2))


# --- MADPO ------------------------------------------------------------------------------------------

def test_batched_pair_log_probs_equal_one_at_a_time(make):
    trainer = make(MADPOTrainer)
    from comlrl.engine.timing import PhaseTimer

    pairs, _ = trainer._generate_pairs(PhaseTimer())
    assert pairs and all(p.winner_reward > p.loser_reward for p in pairs)
    with torch.no_grad():
        for a in range(2):
            chosen, rejected = trainer._pair_log_probs(a, pairs)
            for i, pair in enumerate(pairs):
                c, r = trainer._pair_log_probs(a, [pair])
                assert c.item() == pytest.approx(chosen[i].item(), abs=1e-4)
                assert r.item() == pytest.approx(rejected[i].item(), abs=1e-4)


def test_madpo_trains_checkpoints_the_pairs_and_resumes_exactly(make, tmp_path):
    full = make(MADPOTrainer, num_train_epochs=3, output_dir=str(tmp_path / "f"))
    full.train(checkpoint_dir=tmp_path / "full")
    logged = rows(tmp_path / "full")
    assert logged[0]["preference/pairs"] == 8 and logged[0]["env_step"] == 0  # the pair set: the first row
    assert logged[-1]["env_step"] == 3 * 8 * 2 and logged[-1]["global_step"] == 12
    assert {"train/dpo_loss", "agent_1/chosen_reward", "train/preference_accuracy"} <= set(logged[-1])
    for cut in ("checkpoint-1", "checkpoint-3"):  # right after the pairs; after DPO epoch 2
        part = tmp_path / f"part-{cut}"
        make(MADPOTrainer, num_train_epochs=3, output_dir=str(part)).train(checkpoint_dir=part)
        resumed = make(MADPOTrainer, num_train_epochs=3, output_dir=str(part))
        sampled = []
        resumed.backend.sample = lambda *a, **k: sampled.append(1)  # a resume never samples the pairs again
        resumed.train(resume_from_checkpoint=part / cut, checkpoint_dir=part)
        assert not sampled
        assert_bit_exact(state_of(full), state_of(resumed))
        assert rows(part) == logged


@pytest.mark.parametrize("cls", [MADPOTrainer, MADPOIterTrainer])
def test_held_out_pairs_leave_training_unchanged(make, tmp_path, cls):
    """preference_pairs(): pairs of other prompts, from seeds no training set uses, with every
    random state restored, so a run that calls it trains exactly as one that does not."""
    full = make(cls, num_train_epochs=2, output_dir=str(tmp_path / "a"))
    full.train()
    probed = make(MARLHFTrainer, num_train_epochs=1, output_dir=str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="preference_pairs\\(\\) needs prompts"):
        probed.preference_pairs()
    probed = make(cls, num_train_epochs=2, output_dir=str(tmp_path / "b"),
                  trainer_kwargs={"eval_dataset": [{"prompt": "Name a colour."}, {"prompt": "Name a city."}]})
    held_out = probed.preference_pairs()
    assert held_out and {p.item_index for p in held_out} <= {0, 1}
    assert all(p.winner_reward > p.loser_reward for p in held_out)
    assert {p.prompts[0] for p in held_out} <= {"Name a colour.", "Name a city."}
    again = probed.preference_pairs([{"prompt": "Name a colour."}, {"prompt": "Name a city."}])
    assert [p.winner_completions for p in again] == [p.winner_completions for p in held_out]  # own seeds
    probed.train()
    assert_bit_exact(state_of(full), state_of(probed))


def test_madpo_micro_batches_give_the_same_step(make):
    """The first optimizer step's gradients, one batch vs one pair per micro-batch (tolerance: see
    helpers.GRADIENT_RTOL); the later steps start from weights AdamW made slightly different."""
    a, b = make(MADPOTrainer, num_train_epochs=1), make(MADPOTrainer, num_train_epochs=1, micro_batch_size=1)
    steps_a, steps_b = record_gradients(a), record_gradients(b)
    a.train()
    b.train()
    assert len(steps_a) == len(steps_b) >= 2
    assert_same_gradients(steps_a[0], steps_b[0])


def test_reference_free_loss_is_comlrl_143s(make):
    trainer = make(MADPOTrainer, dpo_reference="none", num_train_epochs=1)
    trainer.train()
    assert torch.count_nonzero(trainer._pair_set.ref) == 0


class _Halves:
    """A centralised adapter that reads a joint completion's first word and the rest as the roles'
    outputs (a random model writes no tags)."""

    def build_prompt(self, item, agent_prompts):
        return " / ".join(agent_prompts)

    def parse_completion(self, completion, item, num_agents):
        first, _, rest = completion.partition(" ")
        return [first, rest]


def test_centralized_madpo_trains_one_joint_actor(model_path, tokenizer, tmp_path):
    trainer = MADPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path)], tokenizer=tokenizer,
                           reward_func=_reward, formatters=[lambda item: item["prompt"], lambda item: "Expand it:"],
                           train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                           args=MADPOConfig(**{**PREF, "collaboration_mode": "centralized", "max_new_tokens": 24,
                                               "output_dir": str(tmp_path / "o")}),
                           centralized_comparator_adapter=_Halves())
    assert trainer.num_agents == 1 and trainer.num_roles == 2 and trainer.reward_func.reward_range == (0.0, 1.0)
    before = state_of(trainer)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in state_of(trainer).items() if ".param." in k)


# --- MARLHF -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["magrpo", "maac"])
def test_marlhf_phases_resume_exactly(make, tmp_path, algorithm):
    extra = {"rl_algorithm": algorithm, "critic_learning_rate": 1e-3}
    full = make(MARLHFTrainer, output_dir=str(tmp_path / "f"), **extra)
    full.train(checkpoint_dir=tmp_path / "full")
    names = sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*"))
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]  # pairs, reward, 2 RL epochs
    logged = rows(tmp_path / "full")
    assert any("reward_model/accuracy" in r for r in logged) and "train/task_reward_mean" in logged[-1]
    files = {p.parent.name for p in (tmp_path / "full" / "checkpoint-3").rglob("model.safetensors")}
    assert "reward-model-0" in files and ("critic-0" in files) == (algorithm == "maac")
    for cut in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):  # before RM training, before RL, mid RL
        part = tmp_path / f"part-{cut}"
        make(MARLHFTrainer, output_dir=str(part), **extra).train(checkpoint_dir=part)
        resumed = make(MARLHFTrainer, output_dir=str(part), **extra)
        resumed.train(resume_from_checkpoint=part / cut, checkpoint_dir=part)
        assert_bit_exact(state_of(full), state_of(resumed))
        assert rows(part) == logged


def test_marlhf_evaluation_uses_the_task_reward(make):
    trainer = make(MARLHFTrainer, trainer_kwargs={"eval_dataset": [{"prompt": p} for p in SEED_PROMPTS]})
    trainer.train()
    evaluated = trainer.evaluate()["eval/reward_mean"]
    assert 0.0 <= evaluated <= 1.0  # the task's scale (the reward model's scores are unbounded)


# --- iterative ----------------------------------------------------------------------------------------

def _resumed_after_fewer_iterations(make, cls, part, settings, iterations):
    """Train ``iterations`` iterations into ``part``, then resume the full run from its newest
    checkpoint; returns the resumed trainer."""
    make(cls, output_dir=str(part), **{**settings, "num_iterations": iterations}).train(checkpoint_dir=part)
    resumed = make(cls, output_dir=str(part), **settings)
    resumed.train(resume_from_checkpoint=find_latest_checkpoint(part), checkpoint_dir=part)
    return resumed


@pytest.mark.parametrize("mode, extra", [("current", {}), ("nearest_k", {"preference_replay_k": 1}),
                                         ("all_history", {"preference_replay_sample_size": 3}),
                                         ("lambda_decay", {"preference_replay_lambda": 0.5})])
def test_iterations_replay_and_resume_exactly(make, tmp_path, mode, extra):
    settings = dict(preference_replay_mode=mode, log_reward_distribution=True, num_iterations=3, **extra)
    full = make(MADPOIterTrainer, output_dir=str(tmp_path / "f"), **settings)
    full.train(checkpoint_dir=tmp_path / "full")
    shards = sorted(p.name for p in (tmp_path / "full" / "preference_replay").iterdir())
    assert shards == [f"iteration_{i:04d}.{ext}" for i in (1, 2, 3) for ext in ("jsonl", "safetensors")]
    record = json.loads((tmp_path / "full" / "preference_replay" / "iteration_0002.jsonl").read_text().splitlines()[0])
    assert {"prompts", "winner_completions", "loser_completions", "target_raw_reward"} <= set(record)
    plots = tmp_path / "full" / "reward_distributions"
    assert (plots / "iteration_0003.png").stat().st_size > 1000
    distribution = json.loads((plots / "iteration_0001.json").read_text())
    assert sum(distribution["candidate"]["target"]["counts"]) == 16  # 4 prompts x 4 candidates
    logged = rows(tmp_path / "full")
    assert [r["iter/current_iteration"] for r in logged if "iter/current_iteration" in r] == [1, 2, 3]
    part = tmp_path / "part"
    resumed = _resumed_after_fewer_iterations(make, MADPOIterTrainer, part, settings, 2)
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(part) == logged


@pytest.mark.parametrize("policy", ["model", "history"])
def test_model_and_history_comparators(make, model_path, tmp_path, policy):
    extra = {"comparator_model_name": str(model_path)} if policy == "model" else {"comparator_history_k": 1}
    trainer = make(MADPOIterTrainer, comparator_policy=policy, **extra)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    logged = rows(tmp_path / "ckpt")
    assert all(r["iter/current_preference_pairs"] > 0 for r in logged if "iter/current_preference_pairs" in r)
    if policy == "history":  # one folder per run
        snapshot = tmp_path / "ckpt" / "policy_checkpoints" / f"run-{trainer.run_id[:8]}" / "iteration_0001"
        assert (snapshot / "agent_1" / "config.json").is_file()


def test_marlhf_iterations_retrain_the_reward_model_and_resume(make, tmp_path):
    settings = dict(preference_scoring_reward="reward_model")
    full = make(MARLHFIterTrainer, output_dir=str(tmp_path / "f"), **settings)
    full.train(checkpoint_dir=tmp_path / "full")
    assert sum("reward_model/loss" in r for r in rows(tmp_path / "full")) == 2  # one reward model per iteration
    # Its epochs share a row (no environment step), which also holds the last epoch's own figures.
    assert all({"reward_model/final_loss", "reward_model/final_accuracy"} <= set(r)
               for r in rows(tmp_path / "full") if "reward_model/loss" in r)
    resumed = _resumed_after_fewer_iterations(make, MARLHFIterTrainer, tmp_path / "part", settings, 1)
    assert_bit_exact(state_of(full), state_of(resumed))


def test_http_comparator_with_timeouts_failures_and_a_secret_key(make, model_path, tmp_path, monkeypatch):
    """An iterative run against a real local HTTP endpoint (the generic JSON format) serving a tiny
    model: retried through a failure, stopped cleanly when the endpoint stays down (nothing of that
    iteration applied, the last checkpoint intact), resumed when it is back, ending exactly where an
    uninterrupted run ends. The API key goes to the endpoint and nowhere else."""
    import comlrl
    from comlrl.exceptions import ComparatorError
    from comlrl.trainers import preference
    from comlrl.trainers.preference import comparators

    from comparator_server import ComparatorServer

    # One class, where users look for it: comlrl, comlrl.exceptions, the family and its module.
    assert comlrl.ComparatorError is preference.ComparatorError is comparators.ComparatorError is ComparatorError
    assert issubclass(ComparatorError, comlrl.TrainingError)

    secret = "sk-test-" + "7" * 24
    monkeypatch.setenv("COMPARATOR_KEY", secret)
    with ComparatorServer(model_path) as server:
        settings = dict(comparator_policy="api", comparator_api_url=server.url, comparator_api_key_env="COMPARATOR_KEY",
                        comparator_api_timeout=1.0, comparator_api_retries=1, num_iterations=3,
                        comparator_api_max_n_per_request=2)
        full = make(MADPOIterTrainer, output_dir=str(tmp_path / "f"), **settings)
        server.fail_next = 1  # one failure: retried
        full.train(checkpoint_dir=tmp_path / "full")
        assert server.headers[0]["Authorization"] == f"Bearer {secret}"
        assert {r["num_return_sequences"] for r in server.requests} == {2}  # 4 candidates in requests of 2
        count = len(server.requests)

        part = tmp_path / "part"
        crashing = make(MADPOIterTrainer, output_dir=str(part), **settings)
        server.fail_next, server.stall_next, server.stall_seconds = 0, 0, 0.0
        calls = {"n": 0}
        real = crashing._api.candidates

        def flaky(*args, **kwargs):  # the endpoint goes down during iteration 2
            calls["n"] += 1
            if calls["n"] == 11:
                server.stall_next, server.stall_seconds = 2, 2.5  # both tries time out
            return real(*args, **kwargs)

        crashing._api.candidates = flaky
        with pytest.raises(ComparatorError, match="failed 2 time"):
            crashing.train(checkpoint_dir=part)
        latest = find_latest_checkpoint(part)
        meta = read_checkpoint_metadata(latest)  # iteration 1 complete; nothing of iteration 2 saved
        assert latest.name == "checkpoint-2" and meta["global_step"] == 4 and meta["epoch"] == 1
        resumed = make(MADPOIterTrainer, output_dir=str(part), **settings)
        resumed.train(resume_from_checkpoint=latest, checkpoint_dir=part)
        assert_bit_exact(state_of(full), state_of(resumed))
        assert len(server.requests) > count
    for path in list((tmp_path / "full").rglob("*")) + list(part.rglob("*")):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_config_rules():
    with pytest.raises(ConfigError, match="num_turns"):
        MADPOConfig(num_turns=2)
    with pytest.raises(ConfigError, match="must be None"):
        MADPOConfig(pair_selection="all")
    with pytest.raises(ConfigError, match="num_generations"):
        MARLHFConfig(rl_algorithm="magrpo", num_generations=1)
    assert MARLHFConfig(rl_algorithm="marloo").advantage_mode == "rloo"
    assert MARLHFConfig(rl_algorithm="MAREFORCE").rl_algorithm == "mareinforce"
    with pytest.raises(ConfigError, match="comparator_api_url"):
        MADPOIterConfig(comparator_policy="api")
    with pytest.raises(ConfigError, match="API key"):
        MADPOIterConfig(comparator_api_headers={"Authorization": "Bearer x"})
    with pytest.raises(ConfigError, match="preference_replay_k is required"):
        MADPOIterConfig(preference_replay_mode="nearest_k")
    config = MARLHFIterConfig(comparator_policy="api", comparator_api_url="http://x", comparator_api_key="sk-secret")
    assert config.to_dict()["comparator_api_key"] == "<redacted>"
    assert MADPOIterConfig().pair_selection == "comparator_reward"


def test_reward_distribution_needs_a_declared_range(model_path, tokenizer):
    with pytest.raises(ConfigError, match="reward_range"):
        MADPOIterTrainer(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                         args=MADPOIterConfig(log_reward_distribution=True))
