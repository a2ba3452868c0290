"""The small code model (comlrl.testing.code_model_dir): fine-tuned offline on the generated task's
train split only, deterministic, cached, loadable with from_pretrained, and weak but not useless
on the held-out problems (RL has work to do)."""

from __future__ import annotations

import pytest
import torch

from comlrl import testing
from comlrl.tasks.code import generated_split


def test_the_corpus_holds_train_problems_only():
    pairs = testing.code_sft_corpus()
    train, evals = generated_split()
    assert len(pairs) > 2 * len(train)   # several rows per train composition, two roles each
    held = set(evals["entry_point"])
    assert not [p for p, _ in pairs if any(f"def {name}(" in p for name in held)]
    assert {c for _, c in pairs} >= {train[0]["aux_solution"], train[0]["main_solution"]}


def test_build_is_deterministic_cached_and_loadable(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = testing.code_model_dir(steps=2, cache_dir=tmp_path / "a")
    second = testing.code_model_dir(steps=2, cache_dir=tmp_path / "b")
    one, two = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (first, second))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    monkeypatch.setattr(testing, "build_code_model", lambda **_: pytest.fail("rebuilt a cached model"))
    assert testing.code_model_dir(steps=2, cache_dir=tmp_path / "a") == first
    tokenizer = AutoTokenizer.from_pretrained(first)
    code = "def aux(numbers):\n    return [x for x in numbers if x > 3]\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code
    assert tokenizer.eos_token == testing.EOS


@pytest.mark.slow
def test_the_warm_model_is_weak_but_writes_working_code(tmp_path):
    """Issue 28: pass@1 on the held-out problems between 5% and 50% (measured 0.XX on this
    machine; the model is built once into the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.sandbox import Sandbox
    from comlrl.tasks.code import (code_collab_reward, code_eval_logger, helper_formatter, main_formatter,
                                   pass_at_k_aggregator)
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    path = testing.code_model_dir()
    train, evals = generated_split()
    with Sandbox(timeout_s=5, workers=2) as sandbox:
        trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
                                tokenizer=AutoTokenizer.from_pretrained(path),
                                formatters=[helper_formatter, main_formatter], reward_func=code_collab_reward(sandbox),
                                train_dataset=train, eval_dataset=evals, eval_logger=code_eval_logger(sandbox),
                                eval_aggregator=pass_at_k_aggregator(),
                                args=MAGRPOConfig(num_generations=4, max_new_tokens=48, eval_num_samples=0,
                                                  eval_batch_size=16, output_dir=str(tmp_path)))
        metrics = trainer.evaluate()
        trainer.close()
    assert 0.05 <= metrics["eval/pass@1"] <= 0.5, metrics
