import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl import ConfigError, DataError, MAGRPOConfig, MAGRPOTrainer, RewardError, TokenizerError
from comlrl.engine.prompts import render_prompt
from comlrl.testing import build_tiny_tokenizer, tiny_model_dir
from comlrl.utils import batched_reward

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, never_stepped, play, state_of


def config(**overrides):
    return MAGRPOConfig(**{**TEST_SETTINGS, **overrides})


def params(trainer):
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in trainer.agents]


def metrics_rows(trainer):
    path = f"{trainer.args.output_dir}/metrics.jsonl"
    return [json.loads(line) for line in open(path)]


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k != "run_id"} for r in rows]


def test_seed_run_trains_and_logs_at_env_step(make_trainer):
    trainer = make_trainer()
    before = params(trainer)
    trainer.train()
    rows = metrics_rows(trainer)
    # 4 prompts, batch 1, 2 epochs -> 8 optimizer steps; each scores K=4 joint actions.
    assert [r["env_step"] for r in rows] == [4 * i for i in range(1, 9)]
    assert trainer.state.env_step == 32 and trainer.state.global_step == 8
    keys = set(rows[0])
    for k in ("train/reward_mean", "agent_0/loss", "agent_1/loss", "train/agent_0/completion_length",
              "agent_0/grad_norm", "turn_1/reward_mean", "turn_1/expected_return", "train/learning_rate",
              "timing/rollout", "timing/score", "timing/advantage", "timing/update", "epoch"):
        assert k in keys
    after = params(trainer)
    for agent_before, agent_after in zip(before, after):
        assert any(not torch.equal(agent_before[n], agent_after[n]) for n in agent_before)


def test_same_seed_same_run_and_other_seed_differs(make_trainer, tmp_path):
    runs = []
    for seed, sub in ((7, "a"), (7, "b"), (8, "c")):
        t = make_trainer(seed=seed, num_train_epochs=1, output_dir=str(tmp_path / sub))
        t.train()
        runs.append((params(t), without_timing(metrics_rows(t))))
    (p1, m1), (p2, m2), (p3, m3) = runs
    assert m1 == m2
    assert all(torch.equal(a[n], b[n]) for a, b in zip(p1, p2) for n in a)
    assert m1 != m3


def test_logging_steps_averages_the_window(make_trainer, tmp_path):
    every = make_trainer(num_train_epochs=1, output_dir=str(tmp_path / "every"))
    every.train()
    pairs = make_trainer(num_train_epochs=1, logging_steps=8, output_dir=str(tmp_path / "pairs"))  # env steps
    pairs.train()
    r1, r2 = metrics_rows(every), metrics_rows(pairs)
    # CoMLRL's cadence: the first row, then once env_step moved 8 past the last row; plus the epoch's end.
    assert [r["env_step"] for r in r2] == [4, 12, 16]
    windows = [[0], [1, 2], [3]]
    for row, steps in zip(r2, windows):
        expected = sum(r1[i]["train/reward_mean"] for i in steps) / len(steps)
        assert row["train/reward_mean"] == pytest.approx(expected, abs=1e-12)


def _gradients_of_first_step(trainer, monkeypatch):
    """Run one optimizer step and return each agent's gradient just before AdamW applies it."""
    import comlrl.engine.trainer as magrpo  # where the optimizer step of every family is taken

    captured = []
    apply = magrpo.apply_gradients

    def spy(models, *args, **kwargs):
        if len(captured) < len(trainer.agents):  # the first step's calls: one per agent, in order
            captured.extend({n: p.grad.clone() for n, p in m.named_parameters()} for m in models)
        return apply(models, *args, **kwargs)

    monkeypatch.setattr(magrpo, "apply_gradients", spy)
    trainer.train()
    return captured


def test_micro_batches_give_the_gradient_of_the_whole_step(make_trainer, tmp_path, monkeypatch):
    """Memory knob only: 4 prompts per optimizer step in micro-batches of 1 group == all at once."""
    # Compared on gradients: Adam's first step is ~lr * sign(g), which amplifies rounding noise.
    settings = dict(num_train_epochs=1, rollout_buffer_size=4, train_batch_size=4)
    a = make_trainer(micro_batch_size=1, output_dir=str(tmp_path / "a"), **settings)
    b = make_trainer(output_dir=str(tmp_path / "b"), **settings)
    ga, gb = _gradients_of_first_step(a, monkeypatch), _gradients_of_first_step(b, monkeypatch)
    assert a.state.global_step == b.state.global_step == 1
    ra, rb = metrics_rows(a)[0], metrics_rows(b)[0]
    assert ra["train/reward_mean"] == pytest.approx(rb["train/reward_mean"], abs=1e-12)
    assert ra["agent_0/loss"] == pytest.approx(rb["agent_0/loss"], abs=1e-6)
    for agent_a, agent_b in zip(ga, gb):
        for n in agent_a:
            torch.testing.assert_close(agent_a[n], agent_b[n], atol=1e-6, rtol=1e-4)


def test_agents_updated_one_after_another_equal_all_updated_together(make_trainer, tmp_path, monkeypatch):
    """Each agent's update is applied, and its gradients freed, before the next agent's backward;
    the weights are those of one optimizer step over every agent at once, bit for bit."""
    from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer

    settings = dict(num_train_epochs=2, rollout_buffer_size=2, train_batch_size=1, micro_batch_size=1)
    in_turn = make_trainer(output_dir=str(tmp_path / "turn"), **settings)
    held = []  # parameters of other agents holding a gradient during each agent's backward

    def hook(agent):
        def check(grad):
            held.append(sum(p.grad is not None for b, m in enumerate(in_turn.agents) if b != agent
                            for p in m.parameters()))
        return check

    for a, model in enumerate(in_turn.agents):  # fires during the agent's backward
        model.get_input_embeddings().weight.register_hook(hook(a))
    in_turn.train()
    assert held and not any(held)

    def together(self, buffer, groups):  # the order before: every backward, then every step
        outs = [self.agent_backward(buffer, a, groups) for a in range(len(self.agents))]
        metrics, norms = self.step_modules(self.agents, self.optimizers, self.schedulers)
        assert norms is not None and all(o is not None for o in outs)
        return metrics

    monkeypatch.setattr(MAGRPOTrainer, "optimizer_step", together)
    at_once = make_trainer(output_dir=str(tmp_path / "once"), **settings)
    at_once.train()
    assert at_once.state.global_step == in_turn.state.global_step == 8
    assert_bit_exact(state_of(in_turn), state_of(at_once))


def test_a_buffer_of_several_steps(make_trainer, tmp_path):
    """rollout_buffer_size=4, train_batch_size=2: 4 prompts sampled at once, then 2 optimizer steps
    (CoMLRL's buffer); the buffer's prompts are sampled exactly as one prompt at a time."""
    buffered = make_trainer(num_train_epochs=1, rollout_buffer_size=4, train_batch_size=2,
                            output_dir=str(tmp_path / "b"))
    single = make_trainer(num_train_epochs=1, output_dir=str(tmp_path / "s"))
    texts = [t.rollouts[0].texts for t in play(buffered, [0, 1, 2, 3])]
    assert texts == [sum((t.rollouts[0].texts for i in range(4) for t in play(single, [i])), [])]
    buffered.train()
    assert buffered.state.global_step == 2 and buffered.state.env_step == 16
    assert len(metrics_rows(buffered)) == 1


def test_one_agent_is_grpo(make_trainer, monkeypatch):
    """One MAGRPO step with one agent == a hand-written GRPO step on the same samples."""
    trainer = make_trainer(num_agents=1, reward_func=lambda c: [len(x) % 7 / 7 for x in c], num_train_epochs=1,
                           rollout_buffer_size=2, advantage_normalization=True, max_grad_norm=None,
                           agent_learning_rate=1e-3)
    reference = AutoModelForCausalLM.from_pretrained(trainer.agents[0].config._name_or_path)
    reference.load_state_dict(trainer.agents[0].state_dict())
    captured = {}
    sample = trainer.backend.sample

    def spy_sample(*args, **kwargs):
        captured.setdefault("rollouts", sample(*args, **kwargs))
        return captured["rollouts"]

    monkeypatch.setattr(trainer.backend, "sample", spy_sample)
    grads = _gradients_of_first_step(trainer, monkeypatch)[0]
    ro = captured["rollouts"][0]
    assert len(ro.texts) == 2 * trainer.args.num_generations

    # GRPO by hand, one completion at a time, no padding anywhere.
    rewards = torch.tensor([len(t) % 7 / 7 for t in ro.texts], dtype=torch.float64)
    grouped = rewards.view(-1, trainer.args.num_generations)
    std = grouped.std(1, unbiased=False, keepdim=True)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / torch.where(std > 1e-6, std, torch.ones_like(std))).view(-1)
    losses = []
    for r in range(len(ro.texts)):
        prompt = ro.prompt_ids[r][ro.prompt_mask[r].bool()]
        n = int(ro.completion_mask[r].sum())
        completion = ro.completion_ids[r, :n]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, completion.unsqueeze(1)).squeeze(1)
        losses.append(-adv[r].float() * logp.mean())
    torch.stack(losses).mean().backward()
    assert any(p.grad.abs().max() > 0 for p in reference.parameters())
    for n, p in reference.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-4)


def test_agent_order_permuted_permutes_the_results(model_path, tokenizer, tmp_path, monkeypatch):
    """Swapping the agents (and the reward's arguments) swaps every agent's losses and weights.

    An agent's sampling seeds follow its position (two copies of one model must not sample alike),
    so the swapped run is given the swapped seeds; everything else must not depend on the order."""
    import comlrl.engine.trainer as engine

    seeds = engine.train_seeds

    def reward(first, second):
        return [math.exp(-abs(len(b) / max(len(a), 1) - 2)) for a, b in zip(first, second)]

    def swapped(second, first):
        return reward(first, second)

    runs = []
    for order, func in (((0, 1), reward), ((1, 0), swapped)):
        monkeypatch.setattr(engine, "train_seeds", lambda seed, epoch, order=order: (
            lambda agent, node, g: seeds(seed, epoch)(order[agent], node, g)))
        models = [AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)]
        with torch.no_grad():  # two different agents
            next(models[1].parameters()).mul_(1.5)
        trainer = MAGRPOTrainer(agents=[models[i] for i in order], tokenizer=tokenizer, reward_func=func,
                                train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                                args=config(num_train_epochs=1, max_new_tokens=8, agent_learning_rate=1e-3,
                                            output_dir=str(tmp_path / str(order))))
        trainer.train()
        runs.append((trainer, metrics_rows(trainer)))
    (straight, rows_a), (crossed, rows_b) = runs
    for ra, rb in zip(rows_a, rows_b):
        assert ra["train/reward_mean"] == pytest.approx(rb["train/reward_mean"], abs=1e-12)
        assert ra["agent_0/loss"] == pytest.approx(rb["agent_1/loss"], rel=1e-5, abs=1e-7)
    for a, b in ((0, 1), (1, 0)):
        for x, y in zip(straight.agents[a].parameters(), crossed.agents[b].parameters()):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_other_architectures_train(kind, tmp_path):
    path = tiny_model_dir(kind)
    tok = AutoTokenizer.from_pretrained(path)
    trainer = MAGRPOTrainer(agent_model=str(path), num_agents=2, tokenizer=tok, reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:2]],
                            args=config(num_train_epochs=1, max_new_tokens=8, agent_learning_rate=1e-3,
                                        output_dir=str(tmp_path)))
    before = params(trainer)
    trainer.train()
    assert trainer.state.env_step == 8
    assert any(not torch.equal(before[0][n], p) for n, p in trainer.agents[0].named_parameters())


def test_agent_model_path_loads_num_agents_and_tokenizer(model_path, tmp_path):
    trainer = MAGRPOTrainer(agent_model=str(model_path), num_agents=3,
                            reward_func=lambda a, b, c: [0.0] * len(a),
                            train_dataset=[{"prompt": "hi"}], args=config(output_dir=str(tmp_path)))
    assert trainer.num_agents == 3 and len({id(a) for a in trainer.agents}) == 3
    assert trainer.model_name == str(model_path) and trainer.tokenizers[0] is trainer.tokenizers[2]
    by_name = MAGRPOTrainer(agents=[str(model_path)] * 2, reward_func=length_ratio_reward,
                            args=config(num_train_epochs=1, max_new_tokens=4, output_dir=str(tmp_path / "n")))
    assert by_name.num_agents == 2 and by_name.agents[0] is not by_name.agents[1]
    assert by_name.train_dataset is None  # given later, as CoMLRL allows
    by_name.train_dataset = [{"prompt": "hi"}]
    by_name.train()
    assert by_name.env_step == 4


def test_agent_model_instance_is_copied_and_shuffle_off_keeps_dataset_order(model_path, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    trainer = MAGRPOTrainer(agent_model=model, num_agents=2, tokenizer=tokenizer, reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                            args=config(shuffle=False, output_dir=str(tmp_path)))
    assert trainer.agents[0] is model and trainer.agents[1] is not model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trainer.agents[1].parameters()))
    assert trainer.epoch_order(5) == [0, 1, 2, 3]
    shuffled = MAGRPOTrainer(agent_model=model_path, tokenizer=tokenizer, reward_func=length_ratio_reward,
                             train_dataset=[{"prompt": p} for p in SEED_PROMPTS] * 4,
                             args=config(output_dir=str(tmp_path)))
    orders = [shuffled.epoch_order(e) for e in range(3)]
    assert all(sorted(o) == list(range(16)) for o in orders) and orders[0] != orders[1]


def test_heterogeneous_agents_with_one_tokenizer_each(tokenizer, tmp_path):
    q = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"))
    g = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2"))
    trainer = MAGRPOTrainer(agents=[q, g], tokenizer=[tokenizer, AutoTokenizer.from_pretrained(tiny_model_dir("gpt2"))],
                            reward_func=length_ratio_reward, train_dataset=[{"prompt": "hi"}],
                            args=config(num_train_epochs=1, max_new_tokens=6, output_dir=str(tmp_path)))
    trainer.train()
    assert trainer.state.env_step == 4


# --- bad input -------------------------------------------------------------------------------------

def test_empty_dataset_and_missing_prompt_column(make_trainer):
    with pytest.raises(DataError, match="empty"):
        make_trainer(dataset=[])
    with pytest.raises(DataError, match="no 'prompt' column"):
        make_trainer(dataset=[{"question": "why?"}])
    with pytest.raises(DataError, match="neither a string nor chat messages"):
        make_trainer(dataset=[{"prompt": 42}])
    # a formatter makes a prompt out of any column
    trainer = make_trainer(dataset=[{"question": "why?"}], trainer_kwargs={"formatters": lambda row: row["question"]})
    assert trainer._table("train").prompts == (("why?",), ("why?",))


def test_formatter_errors_are_named(make_trainer):
    with pytest.raises(DataError, match="formatter of agent 0 failed on train_dataset row 0: KeyError"):
        make_trainer(trainer_kwargs={"formatters": lambda row: row["missing"]})
    with pytest.raises(DataError, match="Make the formatter return text"):
        make_trainer(trainer_kwargs={"formatters": lambda row: ["not", "a", "string"]})
    with pytest.raises(ConfigError, match="formatters has 1 entries for 2 agents"):
        make_trainer(trainer_kwargs={"formatters": [lambda r: r["prompt"]]})


def test_tokenizer_without_pad_token_uses_eos(model_path, tmp_path):
    tok = build_tiny_tokenizer(pad_token=None)
    assert tok.pad_token_id is None
    trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                            tokenizer=tok, reward_func=length_ratio_reward, train_dataset=[{"prompt": "hi"}],
                            args=config(num_train_epochs=1, max_new_tokens=6, output_dir=str(tmp_path)))
    assert tok.pad_token_id == tok.eos_token_id
    trainer.train()


def test_incompatible_tokenizers_are_refused(model_path, tokenizer, tmp_path):
    small = AutoModelForCausalLM.from_pretrained(tiny_model_dir(vocab_size=300))
    big = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(TokenizerError, match="512 tokens but its model's embedding has only 300 rows"):
        MAGRPOTrainer(agents=[big, small], tokenizer=tokenizer, reward_func=length_ratio_reward,
                      train_dataset=[{"prompt": "hi"}], args=config(output_dir=str(tmp_path)))
    with pytest.raises(TokenizerError, match="tokenizers length \\(3\\) must match the number of agents \\(2\\)"):
        MAGRPOTrainer(agents=[big, small], tokenizer=[tokenizer] * 3, reward_func=length_ratio_reward,
                      train_dataset=[{"prompt": "hi"}], args=config(output_dir=str(tmp_path)))
    with pytest.raises(TokenizerError, match="must be provided when agents are model objects"):
        MAGRPOTrainer(agents=[big, small], reward_func=length_ratio_reward, train_dataset=[{"prompt": "hi"}],
                      args=config())


def test_bad_agents_arguments(model_path, tokenizer, caplog):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(ConfigError, match="Either agent_model or agents"):
        MAGRPOTrainer(reward_func=length_ratio_reward, train_dataset=[{"prompt": "x"}], args=config())
    with pytest.raises(ConfigError, match="reward_func"):
        MAGRPOTrainer(agents=[model], tokenizer=tokenizer, train_dataset=[{"prompt": "x"}], args=config())
    with pytest.raises(ConfigError, match="args must be a MAGRPOConfig"):
        MAGRPOTrainer(agents=[model], tokenizer=None, reward_func=length_ratio_reward,
                      train_dataset=[{"prompt": "x"}], args={"num_generations": 4})
    with pytest.raises(ConfigError, match="agents length \\(2\\) must match num_agents \\(3\\)"):
        MAGRPOTrainer(agents=[model_path, model_path], num_agents=3, reward_func=length_ratio_reward, args=config())
    # One object for two agents would train one set of weights with two optimizers: it is copied.
    trainer = MAGRPOTrainer(agents=[model, model], tokenizer=tokenizer, reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": "x"}], args=config())
    assert trainer.agents[0] is model and trainer.agents[1] is not model and "its own copy" in caplog.text


@pytest.mark.parametrize("bad_reward, words", [
    (lambda a, b: [1.0] * (len(a) - 1), "returned 0 value.s. for 1 joint action.s. of one call; it is called once "
                                         "per joint action"),
    (batched_reward(lambda a, b: [1.0] * (len(a) - 1)), "returned 3 value.s. for 4 joint action"),
    (lambda a, b: [math.nan] * len(a), "finite"),
    (lambda a, b: ["good"] * len(a), "non-number"),
    (lambda a, b: 1 / 0, "ZeroDivisionError"),
])
def test_bad_rewards_stop_training_before_any_update(make_trainer, bad_reward, words):
    trainer = make_trainer(reward_func=bad_reward)
    before = params(trainer)
    with pytest.raises(RewardError, match=words):
        trainer.train()
    assert all(torch.equal(before[i][n], p) for i, m in enumerate(trainer.agents) for n, p in m.named_parameters())
    assert all(never_stepped(opt) for opt in trainer.optimizers)
    assert trainer.state.global_step == 0


def test_adam_state_allocated_up_front_trains_as_torchs_lazy_state(make_trainer):
    """The AdamW state is created when the trainer is built (comlrl.engine.step.allocate_adam_state)
    exactly as torch creates it at the first step: the same weights and moments, bit for bit."""
    eager, lazy = make_trainer(), make_trainer()
    assert all(len(opt.state) == sum(1 for g in opt.param_groups for p in g["params"]) for opt in eager.optimizers)
    for opt in lazy.optimizers:
        opt.state.clear()  # torch's own lazy initialisation at the first step
    eager.train()
    lazy.train()
    assert_bit_exact(state_of(eager), state_of(lazy))


def test_device_must_exist(make_trainer):
    with pytest.raises(ConfigError, match="agent_devices asks for cuda:7"):
        make_trainer(agent_devices="cuda:7")


def test_every_row_is_formatted_before_training(make_trainer):
    rows = [{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": ""}]
    with pytest.raises(DataError, match="train_dataset row 2 is empty"):
        make_trainer(dataset=rows)
    late = [{"prompt": "a", "n": 1}, {"prompt": "b"}]
    with pytest.raises(DataError, match="failed on train_dataset row 1: KeyError"):
        make_trainer(dataset=late, trainer_kwargs={"formatters": lambda row: row["prompt"] * row["n"]})


def test_logged_learning_rate_is_the_one_the_step_used(make_trainer):
    trainer = make_trainer(num_train_epochs=1, warmup_steps=3)
    trainer.train()
    lrs = [r["train/learning_rate"] for r in metrics_rows(trainer)]
    assert lrs == pytest.approx([1e-3 * 1 / 4, 1e-3 * 2 / 4, 1e-3 * 3 / 4, 1e-3])


def test_loss_uses_the_sampling_policy_even_with_dropout(tmp_path):
    """GPT-2 has dropout 0.1: the loss forward must run it off, like sampling does."""
    from comlrl.engine.step import AgentRows, policy_backward

    path = tiny_model_dir("gpt2")
    model = AutoModelForCausalLM.from_pretrained(path, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    trainer = MAGRPOTrainer(agents=[model], tokenizer=AutoTokenizer.from_pretrained(path),
                            reward_func=lambda c: [float(len(x)) for x in c], train_dataset=[{"prompt": "hi"}],
                            args=config(max_new_tokens=6, output_dir=str(tmp_path)))
    model.train()
    ro = play(trainer, [0])[0].rollouts[0]
    rows = AgentRows(ro, torch.linspace(-1, 1, len(ro.texts), dtype=torch.float64), torch.zeros(len(ro.texts),
                                                                                              dtype=torch.long))
    losses = [policy_backward(model, rows, lambda r, g: r.float(), temperature=1.0, loss_type="grpo",
                              max_new_tokens=6, denominator=len(ro.texts), micro_groups=None).loss for _ in range(2)]
    assert losses[0] == losses[1]


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_messages_are_rendered_with_each_agents_template(model_path, tmp_path):
    chat_tok, plain_tok = build_tiny_tokenizer(), build_tiny_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]}]
    trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path)], tokenizer=chat_tok,
                            reward_func=lambda c: [float(len(x)) for x in c], train_dataset=rows,
                            args=config(num_train_epochs=1, max_new_tokens=4, output_dir=str(tmp_path)))
    table = trainer._table("train")
    assert render_prompt(chat_tok, table.prompts[0][0], table.chat[0]) == \
        "<|system|>Be brief.\n<|user|>Name a city.\n<|assistant|>"
    assert render_prompt(chat_tok, "Next turn", True) == "<|user|>Next turn\n<|assistant|>"
    trainer.train()
    with pytest.raises(TokenizerError, match="no chat_template"):
        MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path)], tokenizer=plain_tok,
                      reward_func=lambda c: [0.0] * len(c), train_dataset=rows,
                      args=config(output_dir=str(tmp_path))).train()
    with pytest.raises(DataError, match="plain-string prompts for some rows of train_dataset and chat messages"):
        MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path)], tokenizer=chat_tok,
                      reward_func=lambda c: [0.0] * len(c), train_dataset=rows + [{"prompt": "plain"}],
                      args=config(output_dir=str(tmp_path)))


def test_formatters_per_agent_mix_chat_and_plain(model_path, tmp_path):
    chat_tok = build_tiny_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    plain_tok = build_tiny_tokenizer()
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)], tokenizer=[chat_tok, plain_tok],
        reward_func=length_ratio_reward, train_dataset=[{"topic": "rain"}],
        formatters=[lambda r: [{"role": "user", "content": f"Write about {r['topic']}."}],
                    lambda r: f"Critique a text about {r['topic']}:"],
        args=config(num_train_epochs=1, max_new_tokens=4, output_dir=str(tmp_path)))
    table = trainer._table("train")
    assert [render_prompt(tok, table.prompts[a][0], table.chat[a]) for a, tok in enumerate((chat_tok, plain_tok))] == [
        "<|user|>Write about rain.\n<|assistant|>", "Critique a text about rain:"]
    assert table.chat == (True, False)
    trainer.train()


def test_named_variant_trainers(model_path, tokenizer, tmp_path):
    from comlrl.trainers.reinforce import MARLOOConfig, MARLOOTrainer

    common = dict(agent_model=str(model_path), tokenizer=tokenizer, reward_func=length_ratio_reward,
                  train_dataset=[{"prompt": "hi"}])
    trainer = MARLOOTrainer(**common, args=MARLOOConfig(**{**TEST_SETTINGS, "num_train_epochs": 1,
                                                           "max_new_tokens": 4, "output_dir": str(tmp_path)}))
    assert trainer.args.advantage_mode == "rloo" and trainer.algorithm_name == "MARLOO"
    trainer.train()
    assert MARLOOTrainer(**common, args=MARLOOConfig(num_turns=1)).args.advantage_mode == "rloo"
    # As in CoMLRL, the config's baseline is the one used.
    assert MARLOOTrainer(**common, args=config()).args.advantage_mode == "mean"


def test_save_model_writes_loadable_transformers_directories(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1)
    trainer.train()
    out = trainer.save_model(tmp_path / "final")
    for i, agent in enumerate(trainer.agents):
        loaded = AutoModelForCausalLM.from_pretrained(out / f"agent_{i}")
        assert all(torch.equal(a, b) for a, b in zip(agent.state_dict().values(), loaded.state_dict().values()))
        assert len(AutoTokenizer.from_pretrained(out / f"agent_{i}")) == len(trainer.tokenizers[i])
    trainer.save_model(out)  # replaces its own previous save as a whole
    assert not list(tmp_path.glob(".*final*"))
    (out / "agent_0" / "notes.txt").write_text("the user's, not save_model's")
    with pytest.raises(ConfigError, match="already holds files export did not write"):
        trainer.save_model(out)  # a file it did not write is never deleted
    assert (out / "agent_0" / "notes.txt").is_file()


def test_save_model_never_deletes_other_files(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="already holds files export did not write"):
        trainer.save_model(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "checkpoint-1").is_dir() and (tmp_path / "ckpt" / "metrics.jsonl").is_file()


def test_agent_devices_place_each_agent_and_are_checked(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1, agent_devices=["cpu", "cpu"])
    trainer.train()
    assert [next(m.parameters()).device.type for m in trainer.agents] == ["cpu", "cpu"]
    assert make_trainer(agent_devices=["cpu"]).agent_devices == [torch.device("cpu")] * 2  # one for all
    with pytest.raises(ConfigError, match="agent_devices length \\(3\\) must be 1 or 2"):
        make_trainer(agent_devices=["cpu"] * 3)
    with pytest.raises(ConfigError, match="agent_devices asks for cuda:5"):
        make_trainer(agent_devices=["cpu", "cuda:5"])
    # devices may change on resume
    make_trainer(num_train_epochs=1).train(checkpoint_dir=tmp_path / "c")
    make_trainer(num_train_epochs=2, agent_devices=["cpu", "cpu"]).train(
        resume_from_checkpoint=tmp_path / "c" / "checkpoint-1", checkpoint_dir=tmp_path / "c")
