"""What the training scripts of CoMLRL's task repositories (OpenMLRL/LLM_Collab_Writing,
LLM_Collab_Code_Completion, LLM_Collab_Code_Generation) see of comlrl, in small stand-ins:
their reward signatures (tests/fixtures/task_repo_rewards.py), CoMLRL 1.4.3's call shape (one
call per joint action, ``batch_items``/``prompts`` aligned with the completions) recorded from
1.4.3 itself (tests/fixtures/comlrl143_reward_calls.json, made by
make_comlrl143_reward_calls.py), 1.4.2-era eval loggers, ``dataset_type=`` and
``wandb_config["output_dir"]``."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from comlrl import ConfigError, MAGRPOConfig, MAGRPOTrainer, RewardError
from comlrl.engine import trainer as engine_trainer
from comlrl.engine.rewards import RewardFunction
from comlrl.trainers import IACConfig, IACTrainer, MAACConfig, MAACTrainer, MADPOConfig, MADPOTrainer
from comlrl.utils import batched_reward, call_reward_function

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import task_repo_rewards as stand_ins  # noqa: E402

RECORD = json.loads((FIXTURES / "comlrl143_reward_calls.json").read_text())
FORMATTERS = [stand_ins.formatter_0, stand_ins.formatter_1]
SETTINGS = dict(num_turns=1, num_train_epochs=1, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=None,
                eval_interval=0, rollout_buffer_size=1, logging_steps=1)


@pytest.fixture(autouse=True)
def fresh_calls():
    stand_ins.reset()
    yield
    stand_ins.reset()


def _items(run: dict) -> list[list[dict]]:
    """1.4.3's calls of one run, grouped by task item (dataset order, num_generations per item
    for MAGRPO; one call per item for IAC / MAAC)."""
    calls, per = run["calls"], run["num_generations"] if run["trainer"] == "MAGRPO" else 1
    assert len(calls) == len(stand_ins.ROWS) * per
    return [calls[i * per:(i + 1) * per] for i in range(len(stand_ins.ROWS))]


def _replay(run: dict, func, **flags) -> list[float]:
    """Our RewardFunction on the completions 1.4.3 scored, item by item, as a trainer calls it."""
    n, actor_critic = run["num_agents"], run["trainer"] != "MAGRPO"
    reward = RewardFunction(func, n, per_agent=actor_critic, agent_prompts=actor_critic, **flags)
    values = []
    for row, calls in zip(stand_ins.ROWS, _items(run)):
        completions = [[c for call in calls for c in call["completions"][a]] for a in range(n)]
        prompts = [f(row) for f in FORMATTERS[:n]]
        values += reward(completions, prompts[0], dict(row), agent_prompts=prompts).tolist()
    return values


RUNS = RECORD["training"]
RUN_IDS = [f"{r['trainer']}-{r['reward']}-{r['num_agents']}agents" for r in RUNS]


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_a_rewards_arguments_and_values_are_comlrl143s(run):
    """The same completions through our call path give the reward exactly the arguments 1.4.3
    gave it (one call per joint action, rows and prompts beside the completions; the
    actor-critic trainers pass every agent's prompt) and the same rewards."""
    values = _replay(run, stand_ins.REWARDS[run["reward"]])
    assert stand_ins.CALLS == run["calls"]
    assert values == [v for call in run["calls"] for v in call["returned"]]


# leading_prompts counts the prompts it gets (as an actor-critic reward may): not batch-agnostic.
BATCHABLE = [(i, r) for i, r in zip(RUN_IDS, RUNS) if r["trainer"] == "MAGRPO" and r["reward"] != "leading_prompts"]


@pytest.mark.parametrize("run", [r for _, r in BATCHABLE], ids=[i for i, _ in BATCHABLE])
def test_the_batched_opt_in_scores_the_same(run):
    """batched_reward: one call per task item with every joint action, rows and prompts repeated
    to the same length; a reward written for either call shape gives the same rewards."""
    func = stand_ins.REWARDS[run["reward"]]
    batched = batched_reward(functools.wraps(func)(lambda *a, **k: func(*a, **k)))
    values = _replay(run, batched)
    k = run["num_generations"]
    assert len(stand_ins.CALLS) == len(stand_ins.ROWS)
    for call, row in zip(stand_ins.CALLS, stand_ins.ROWS):
        assert all(len(c) == k for c in call["completions"])
        assert call["batch_items"] in (None, [row] * k) and call["prompts"] in (None, [stand_ins.formatter_0(row)] * k)
    assert values == [v for call in run["calls"] for v in call["returned"]]


@pytest.mark.parametrize("direct", RECORD["direct"], ids=[d["reward"] for d in RECORD["direct"]])
def test_public_call_reward_function_is_comlrl143s_call(direct):
    """comlrl.utils.call_reward_function (the engine's binding) on two joint actions at once."""
    values = call_reward_function(stand_ins.REWARDS[direct["reward"]], direct["prompts"], direct["completions"],
                                  num_agents=2, batch_items=direct["batch_items"])
    assert values == direct["values"] and stand_ins.CALLS == direct["calls"]


def _run_ours(kind: str, reward, model_path, tokenizer, num_agents=2, **extra):
    """One epoch of our trainer on the stand-in task (the rows and formatters 1.4.3 was recorded on)."""
    common = dict(tokenizer=tokenizer, reward_func=reward, formatters=FORMATTERS[:num_agents],
                  train_dataset=[dict(r) for r in stand_ins.ROWS])
    if kind == "MAGRPO":
        trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(num_agents)],
                                args=MAGRPOConfig(num_agents=num_agents, num_generations=2, **SETTINGS, **extra),
                                **common)
    else:
        config, cls = (IACConfig, IACTrainer) if kind == "IAC" else (MAACConfig, MAACTrainer)
        trainer = cls(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(num_agents)],
                      critic_model=model_path, args=config(num_agents=num_agents, **SETTINGS, **extra), **common)
    trainer.train()
    return trainer


@pytest.mark.parametrize("kind, name, agents", [("MAGRPO", "varargs_rows", 2), ("MAGRPO", "kwargs_rows", 2),
                                                ("MAGRPO", "varargs_rows", 1), ("IAC", "leading_prompts", 2),
                                                ("MAAC", "keyword_only_rows", 2)])
def test_our_trainers_call_rewards_as_comlrl143_did(kind, name, agents, model_path, tokenizer, tmp_path):
    """Live: as many calls as 1.4.3 made on the same task, each with one completion per agent,
    the row beside it and the prompt 1.4.3 passed (agent 0's formatted prompt; every agent's for
    the actor-critic trainers)."""
    recorded = next(r for r in RUNS if (r["trainer"], r["reward"], r["num_agents"]) == (kind, name, agents))
    _run_ours(kind, stand_ins.REWARDS[name], model_path, tokenizer, agents, output_dir=str(tmp_path))
    assert len(stand_ins.CALLS) == len(recorded["calls"])
    for ours, theirs in zip(stand_ins.CALLS, recorded["calls"]):
        assert [len(c) for c in ours["completions"]] == [len(c) for c in theirs["completions"]] == [1] * agents
        assert ours["prompts"] == theirs["prompts"] and ours["batch_items"] == theirs["batch_items"]


def test_varargs_rewards_get_their_keywords_and_indexing_needs_aligned_rows():
    """CoMLRL's task repositories declare f(*completions, batch_items=None, prompts=None) and index
    batch_items[i] beside completions[i] (Code Completion's reward without a fallback): the rows
    must arrive, one per joint action. (Before this, comlrl dropped keywords from *args rewards
    without **kwargs, and handed K completions with one row.)"""
    seen = []

    def reward(*completions, batch_items=None, prompts=None):
        seen.append((len(completions[0]), batch_items, prompts))
        return [float(batch_items[i]["weight"]) for i in range(len(completions[0]))]

    out = RewardFunction(reward, 2)([["a", "b", "c"], ["d", "e", "f"]], "p", {"weight": 2.0})
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert seen == [(1, [{"weight": 2.0}], ["p"])] * 3


def test_a_reward_asking_for_what_comlrl_does_not_pass_is_refused_when_built(make_trainer):
    def reward(completions1, completions2, *, tokenizer):
        return [0.0] * len(completions1)

    with pytest.raises(RewardError, match=r"asks for 'tokenizer', which comlrl does not pass.*prompts= and "
                                          r"batch_items="):
        make_trainer(reward_func=reward)
    with pytest.raises(RewardError, match="asks for 'tokenizer'"):
        call_reward_function(reward, ["p"], [["a"], ["b"]], num_agents=2)


def test_keyword_only_and_kwargs_rewards_get_rows_and_prompts():
    def keyword_only(a, b, *, batch_items=None, prompts=None):
        return [float(batch_items[0]["weight"]) + len(prompts[0])]

    def kwargs(a, b, **rest):
        assert sorted(rest) == ["batch_items", "prompts"]
        return [float(rest["batch_items"][0]["weight"])]

    assert RewardFunction(keyword_only, 2)([["x"], ["y"]], "pp", {"weight": 1.0}).tolist() == [3.0]
    assert RewardFunction(kwargs, 2)([["x"], ["y"]], "pp", {"weight": 1.0}).tolist() == [1.0]


EVAL_ROWS = [{"prompt": "a b", "test": "assert f(1) == 1", "entry_point": "f"},
             {"prompt": "c", "test": "assert g() is None", "entry_point": "g"}]


def test_a_142_eval_logger_is_called_in_the_form_it_accepts(make_trainer):
    """eval_logger(agent_completions_turns, test_cases, entry_points, prompts) (no batch_items: 1.4.3
    fails with TypeError), and an aggregator without num_turns, called as 1.4.2 called them."""
    seen = {}

    def aggregator(metrics):
        seen["metrics"] = metrics
        return {"n": float(len(metrics))}

    trainer = make_trainer(trainer_kwargs={"eval_dataset": EVAL_ROWS, "eval_logger": stand_ins.eval_logger_142,
                                           "eval_aggregator": aggregator})
    metrics = trainer.evaluate()
    assert metrics["eval/n"] == 2.0
    assert seen["metrics"] == [{"turns": 1, "test": r["test"], "entry": r["entry_point"], "prompt": r["prompt"]}
                               for r in EVAL_ROWS]


def test_a_143_eval_logger_still_gets_batch_items(make_trainer):
    seen = {}

    def logger(*, agent_completions_turns, batch_items, prompts):
        seen["rows"], seen["prompts"] = batch_items, prompts
        return [{"x": 1.0} for _ in batch_items]

    trainer = make_trainer(trainer_kwargs={"eval_dataset": EVAL_ROWS, "eval_logger": logger,
                                           "eval_aggregator": lambda m, num_turns: {"k": float(num_turns)}})
    assert trainer.evaluate()["eval/k"] == 1.0
    assert seen == {"rows": EVAL_ROWS, "prompts": [r["prompt"] for r in EVAL_ROWS]}


def test_an_eval_logger_that_cannot_take_the_completions_is_refused_when_built(make_trainer):
    with pytest.raises(ConfigError, match="must take agent_completions_turns"):
        make_trainer(trainer_kwargs={"eval_logger": lambda a, b: [], "eval_aggregator": lambda m: {}})
    with pytest.raises(ConfigError, match="asks for 'tokenizer'"):
        make_trainer(trainer_kwargs={"eval_logger": lambda agent_completions_turns, tokenizer: [],
                                     "eval_aggregator": lambda m: {}})


def test_dataset_type_is_accepted_with_one_deprecation_warning(make_trainer, monkeypatch):
    """CoMLRL 1.3.9-1.4.2 took dataset_type=; 1.4.3 refuses it (TypeError); the task repos' MAGRPO,
    GRPO, MADPO and MARLHF scripts pass it."""
    monkeypatch.setattr(engine_trainer, "_WARNED", set())
    with pytest.warns(FutureWarning, match="dataset_type= is deprecated") as caught:
        trainer = make_trainer(trainer_kwargs={"dataset_type": "tldr"})
    assert Path(caught[0].filename).name == "conftest.py"  # the line that built the trainer, not comlrl's
    assert trainer.dataset_type == "tldr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer(trainer_kwargs={"dataset_type": "tldr"})  # once per process
    with pytest.raises(ConfigError, match="dataset_type must be a string"):
        make_trainer(trainer_kwargs={"dataset_type": 3})


def test_dataset_type_is_in_the_run_config(make_trainer, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(engine_trainer, "open_trackers", lambda names, args, wandb_config, ctx:
                        seen.setdefault("config", ctx.run_config) and [])
    monkeypatch.setattr(engine_trainer, "_WARNED", {"dataset_type"})
    trainer = make_trainer(num_train_epochs=1, trainer_kwargs={"dataset_type": "humaneval"})
    trainer.train()
    assert seen["config"]["dataset_type"] == "humaneval"


def test_preference_trainers_accept_dataset_type(model_path, tokenizer, monkeypatch):
    monkeypatch.setattr(engine_trainer, "_WARNED", {"dataset_type"})
    trainer = MADPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                           tokenizer=tokenizer, reward_func=stand_ins.kwargs_rows, dataset_type="tldr",
                           train_dataset=[dict(r) for r in stand_ins.ROWS],
                           args=MADPOConfig(num_turns=1, preference_num_candidates=2, preference_pairs_per_sample=1,
                                            max_new_tokens=3))
    assert trainer.dataset_type == "tldr"


def test_wandb_config_output_dir_is_where_the_run_writes(make_trainer, tmp_path):
    """CoMLRL 1.4.3's wandb_config["output_dir"] (the Writing MADPO/MARLHF scripts pass it): the
    folder of the run's outputs; without a checkpoint_dir, metrics.jsonl goes there."""
    target = tmp_path / "job_1"
    trainer = make_trainer(num_train_epochs=1, report_to="jsonl", output_dir="outputs",
                           trainer_kwargs={"wandb_config": {"project": "p", "output_dir": str(target)}})
    assert trainer.outputs_dir == target and trainer.legacy_outputs_dir() == target
    trainer.train()
    assert (target / "metrics.jsonl").is_file()
    with pytest.raises(ConfigError, match="both say where the run's outputs go"):
        make_trainer(output_dir=str(tmp_path / "elsewhere"),
                     trainer_kwargs={"wandb_config": {"output_dir": str(target)}})
    with pytest.raises(ConfigError, match="must be a folder path"):
        make_trainer(trainer_kwargs={"wandb_config": {"output_dir": 7}})


def test_save_model_records_final_model_saved_in_the_wandb_run(make_trainer, tmp_path, monkeypatch):
    """CoMLRL 1.4.3's save_model logs {"final_model_saved": folder} to W&B; here the W&B run of the
    last train() gets it in its summary (resumed by its id)."""
    import wandb

    runs = []

    class Run:
        project, entity, step = "p", None, 0

        def __init__(self, **kwargs):
            self.kwargs, self.id, self.summary, self.rows = kwargs, kwargs["id"], {}, []
            self.dir = str(tmp_path / "wandb" / f"run-{len(runs)}" / "files")
            self.settings = type("S", (), {"_offline": True})()
            runs.append(self)

        def log(self, row, step):
            self.rows.append(step)

        def finish(self, exit_code=0):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Run(**kwargs))
    trainer = make_trainer(num_train_epochs=1, trainer_kwargs={"wandb_config": {"project": "p", "mode": "offline"}})
    trainer.train()
    saved = trainer.save_model(tmp_path / "final")
    assert len(runs) == 2 and runs[1].id == runs[0].id and runs[1].kwargs["resume"] == "allow"
    assert runs[1].summary == {"final_model_saved": str(saved)} and runs[1].rows == []
    assert (saved / "agent_0" / "config.json").is_file()


def test_comlrls_own_rewards_opt_into_batched_calls():
    """The code task checks a call's programs in one sandbox batch and MARLHF's learned reward
    scores a task item's joint answers in one reward-model forward: both stay batched."""
    from comlrl.engine.rewards import reward_is_batched
    from comlrl.tasks.code.rewards import CodeCollabReward, PassRateReward
    from comlrl.trainers.preference.marlhf import MARLHFTrainer

    assert CodeCollabReward.reward_batched and PassRateReward.reward_batched
    assert reward_is_batched(MARLHFTrainer._learned_reward)
    assert not reward_is_batched(stand_ins.varargs_rows)  # everyone else: CoMLRL 1.4.3's call
