"""The small code model (comlrl.testing.code_model_dir): fine-tuned offline on the generated task's
train split only, deterministic, cached, loadable with from_pretrained, and weak but not useless
on the held-out problems (RL has work to do); the package's copy of it is current."""

from __future__ import annotations

import pytest
import torch

from comlrl import testing
from comlrl.tasks.code import generated_split

# One worker under xdist: the slow tests fill the cache with the model (a copy of the package's, or a
# build of minutes where that copy is stale); two workers would do it twice.
pytestmark = pytest.mark.xdist_group("code_model")


def _docstring(prompt: str) -> str:
    return prompt.split('"""')[1].splitlines()[0]


def test_the_corpus_holds_train_compositions_only_and_never_an_rl_row():
    from comlrl.tasks.code import helper_formatter, main_formatter

    pairs = testing.code_sft_corpus()
    train, evals = generated_split()
    rl = testing.code_rl_problems()
    prompts = {p for p, _ in pairs}
    assert len(rl) == min(testing.CODE_RL_PROBLEMS, len(train)) and rl["task_id"] == train["task_id"][:len(rl)]
    assert {_docstring(r["prompt"]) for r in train} == {_docstring(p) for p in prompts}   # every train composition
    assert not {_docstring(r["prompt"]) for r in evals} & {_docstring(p) for p in prompts}  # no held-out one
    assert not prompts & ({helper_formatter(r) for r in rl} | {main_formatter(r) for r in rl})  # no RL row
    assert len(pairs) > 4 * len(train)   # several rows per composition, two roles each


def test_the_corpus_slips_are_the_documented_share_of_each_role():
    """A seeded share of each role's answers holds its slip (aux returns its argument; the entry
    point applies the second step to its argument, not to aux's result); the others are the
    references. One role's share moves none of the other role's answers."""
    pairs = testing.code_sft_corpus()
    aux = [c for p, c in pairs if c.startswith("def aux(")]
    main = [c for p, c in pairs if c.startswith("def solve(")]
    assert len(aux) == len(main) == len(pairs) // 2
    aux_slips = sum(c.splitlines()[1].strip() in ("return numbers", "return text") for c in aux)
    main_slips = sum(" values = aux(" in c and "values" not in c.splitlines()[2] for c in main)
    for count, role in ((aux_slips, "aux"), (main_slips, "main")):
        assert abs(count / len(aux) - testing.CODE_SFT_SLIPS[role]) < 0.06, (role, count / len(aux))
    without = testing.code_sft_corpus(slips={"aux": testing.CODE_SFT_SLIPS["aux"], "main": 0.0})
    assert [c for c in without if c[1].startswith("def aux(")] == [c for c in pairs if c[1].startswith("def aux(")]
    assert not any("values" not in c.splitlines()[2] for _, c in without if c.startswith("def solve("))


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


def test_the_package_s_copy_is_what_the_script_builds_now(tmp_path, monkeypatch):
    """The shipped model's recipe (corpus digest, shape, training settings) is the build's: a change
    to any of them without `python scripts/build_code_model.py --write-asset` fails here. A fresh
    cache gets the copy, not a build; another recipe (here: other steps) is built, never copied."""
    import json

    monkeypatch.delenv("COMLRL_BUILD_CODE_MODEL", raising=False)
    shipped = json.loads((testing.CODE_MODEL_ASSET / testing.CODE_MODEL_RECIPE_FILE).read_text())
    assert shipped["recipe"] == testing.code_model_recipe(), (
        "comlrl/assets/code-model is stale: run python scripts/build_code_model.py --write-asset")
    monkeypatch.setattr(testing, "build_code_model", lambda **_: pytest.fail("built where the copy would do"))
    path = testing.code_model_dir(cache_dir=tmp_path)
    assert (path / "model.safetensors").read_bytes() == (testing.CODE_MODEL_ASSET / "model.safetensors").read_bytes()
    with pytest.raises(pytest.fail.Exception, match="built where"):
        testing.code_model_dir(steps=599, cache_dir=tmp_path)
    with pytest.raises(pytest.fail.Exception, match="built where"):
        testing.code_model_dir(cache_dir=tmp_path / "forced", build=True)
    recipe = testing.code_model_recipe()
    assert testing.code_model_recipe(seed=1)["corpus_sha256"] != recipe["corpus_sha256"]


def test_a_damaged_or_foreign_copy_is_never_used_or_overwritten(tmp_path, monkeypatch):
    """A copy whose file differs from its recorded SHA-256 (a bit flip, a half-installed wheel) is
    built over, not copied; writing a copy refuses a folder that holds something else."""
    import shutil

    monkeypatch.delenv("COMLRL_BUILD_CODE_MODEL", raising=False)
    damaged = tmp_path / "asset"
    shutil.copytree(testing.CODE_MODEL_ASSET, damaged)
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (damaged / "model.safetensors").write_bytes(bytes(weights))
    monkeypatch.setattr(testing, "CODE_MODEL_ASSET", damaged)
    monkeypatch.setattr(testing, "build_code_model", lambda **_: pytest.fail("built"))
    with pytest.raises(pytest.fail.Exception, match="built"):
        testing.code_model_dir(cache_dir=tmp_path / "cache")
    (damaged / "model.safetensors").unlink()
    with pytest.raises(pytest.fail.Exception, match="built"):
        testing.code_model_dir(cache_dir=tmp_path / "cache")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a code-model copy"):
        testing.write_code_model_asset(testing.CODE_MODEL_ASSET, destination=foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_the_warm_model_writes_the_task_s_code(tmp_path):
    """The warm model answers held-out problems in the task's shape and passes some but not most:
    pass@1 0.120 measured (scripts/build_code_model.py; issue 28 asks for 5-50%). The model is the
    package's copy (see the test above), or built once into the cache where that copy is stale."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.sandbox import Sandbox
    from comlrl.tasks.code import (code_collab_reward, code_eval_logger, helper_formatter, main_formatter,
                                   pass_at_k_aggregator, repeat_rows)
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    path = testing.code_model_dir()
    train, evals = generated_split()
    with Sandbox(timeout_s=5, workers=2) as sandbox:
        trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
                                tokenizer=AutoTokenizer.from_pretrained(path),
                                formatters=[helper_formatter, main_formatter], reward_func=code_collab_reward(sandbox),
                                train_dataset=train, eval_dataset=repeat_rows(evals, 4),
                                eval_logger=code_eval_logger(sandbox),
                                eval_aggregator=pass_at_k_aggregator(),
                                args=MAGRPOConfig(num_turns=1, num_generations=4, max_new_tokens=48, eval_num_samples=0,
                                                  eval_batch_size=16, output_dir=str(tmp_path)))
        metrics = trainer.evaluate()
        trainer.close()
    assert metrics["eval/reward_mean"] >= 1.0 and 0.05 <= metrics["eval/pass@1"] <= 0.5, metrics


@pytest.mark.slow
def test_the_example_reports_pass_at_1_from_before_training(tmp_path):
    """examples/code_collab.py on its defaults (small code model, generated task), shortened: the
    isolation table, eval/pass@1 rows in metrics.jsonl with the first before any update, turn-2
    pass@1, final_eval.json, the table and the plot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "examples/code_collab.py", "--train-size", "4", "--eval-size", "4",
                           "--eval-every", "2", "--prompts-per-step", "2", "--epochs", "1", "--turns", "2",
                           "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sandbox isolation (" in proc.stdout and "turn-2 pass@1" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(evals) == 2 and evals[0]["global_step"] == 0 and "eval/turn_2/pass@1" in evals[0]
    assert rows[0] is evals[0] and any("train/reward_mean" in r for r in rows)
    assert "eval/pass@1" in json.loads((tmp_path / "final_eval.json").read_text())
    assert (tmp_path / "code_collab.png").stat().st_size > 0


@pytest.mark.parametrize("flag", ["--epochs", "--eval-samples"])
def test_the_example_refuses_zero_epochs_or_eval_samples_before_loading_anything(flag):
    """0 is a value, not "use the default": it is refused with the flag's name, before a model loads."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "examples/code_collab.py", flag, "0"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2 and "--epochs and --eval-samples must be >= 1" in proc.stderr
    assert "model:" not in proc.stdout
