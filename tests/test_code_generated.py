"""The generated code task (comlrl.tasks.code.generated): HumanEval-format rows of two-step
problems, seeded, with a train/eval split that shares no composition."""

from __future__ import annotations

import ast
import doctest

import pytest

from comlrl.sandbox import Sandbox
from comlrl.tasks.code import (CollabLevels, code_collab_reward, generated_rows, generated_split, tests_for)
from comlrl.tasks.code.generated import GENERATED_COLUMNS, compositions


@pytest.fixture(scope="module")
def rows():
    return generated_rows(seed=0)


@pytest.fixture(scope="module")
def box():
    with Sandbox(timeout_s=5, workers=2) as sandbox:
        yield sandbox


def test_rows_are_humaneval_shaped(rows):
    assert len(rows) > 100 and len({r["task_id"] for r in rows}) == len(rows)
    for r in rows:
        assert tuple(r) == GENERATED_COLUMNS
        func = ast.parse(r["prompt"]).body[0]
        assert isinstance(func, ast.FunctionDef) and func.name == r["entry_point"] and ast.get_docstring(func)
        check = ast.parse(r["test"]).body[0]
        assert check.name == "check" and [a.arg for a in check.args.args] == ["candidate"]
        assert len(tests_for(r)) == 5   # one sandbox test per assert


def test_the_same_seed_gives_the_same_rows_and_another_seed_others():
    assert generated_rows(seed=3) == generated_rows(seed=3)
    assert generated_rows(seed=3) != generated_rows(seed=4)


def test_docstring_examples_and_both_reference_answers_are_right(rows):
    for r in rows:
        scope: dict = {}
        exec(r["prompt"] + r["canonical_solution"], scope)   # trusted: our own generated code
        examples = doctest.DocTestParser().get_examples(ast.get_docstring(ast.parse(r["prompt"]).body[0]))
        assert len(examples) == 1 and eval(examples[0].source, scope) == eval(examples[0].want)
        exec(r["test"], scope)
        scope["check"](scope[r["entry_point"]])
        joint: dict = {}
        exec(r["aux_solution"] + r["main_solution"] + r["test"], joint)
        joint["check"](joint[r["entry_point"]])


def test_the_reference_answer_earns_the_full_reward_and_aux_has_a_job(rows, box):
    """The joint reference (aux = step 1, main calls it for step 2) scores the maximum; the main
    function doing step 2 on the raw input fails some test of every problem."""
    reward = code_collab_reward(box)
    sample = rows[::7]
    for r in sample:
        assert reward([r["aux_solution"]], [r["main_solution"]], batch_items=[r]) == [CollabLevels().maximum]
    identity = [(r["main_solution"].replace(f"aux({a})", a), r)
                for r in sample for a in ("numbers", "text") if f"aux({a})" in r["main_solution"]]
    reports = box.check_many([(main, tests_for(r)) for main, r in identity])
    assert len(identity) == len(sample) and all(not rep.all_passed for rep in reports)


def test_redundant_compositions_are_left_out(rows):
    kept = {r["composition"] for r in rows}
    assert "list:reverse:sum" not in kept and "list:abs:count" not in kept   # step 1 never matters
    assert "list:even:sum" in kept and len(kept) < len(compositions())


def test_split_shares_no_composition_and_no_problem():
    train, evals = generated_split(eval_size=20, seed=1, rows_per_composition=3)
    assert len(evals) == 20 and len(train) > 250
    assert not set(train["composition"]) & set(evals["composition"])
    assert set(train["entry_point"]) == set(evals["entry_point"]) == {"solve"}   # the docstring tells them apart
    assert not set(train["prompt"]) & set(evals["prompt"])
    again = generated_split(eval_size=20, seed=1, rows_per_composition=3)
    assert again[1]["task_id"] == evals["task_id"] and again[0]["task_id"] == train["task_id"]


@pytest.mark.parametrize("size", [0, 10_000])
def test_split_refuses_an_empty_part(size):
    with pytest.raises(ValueError, match="eval_size"):
        generated_split(eval_size=size)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="rows_per_composition"):
        generated_rows(rows_per_composition=0)


def test_more_rows_per_composition_keep_the_same_split():
    """A corpus drawn with more rows per composition (the code model's) holds no eval composition
    of the default split (which compositions exist and which are held out cannot depend on it)."""
    _, evals = generated_split()
    train4, evals4 = generated_split(rows_per_composition=4)
    assert evals4["task_id"] == evals["task_id"] and evals4["prompt"] == evals["prompt"]
    assert not set(train4["composition"]) & set(evals["composition"])


def test_every_step_of_a_held_out_problem_is_taught_by_train_problems():
    """Held-out problems are new compositions of steps the train split has (each step of each
    held-out composition is in at least ``min_train_uses`` train compositions), never a step with
    no example; a split that cannot keep that is refused with the numbers to change."""
    def steps(key):
        kind, first, second = key.split(":")
        return [(kind, "first", first), (kind, "second", second)]

    for seed, size, least in ((0, 48, 2), (1, 20, 3)):
        train, evals = generated_split(eval_size=size, seed=seed, min_train_uses=least)
        assert len(evals) == size
        uses: dict = {}
        for key in train["composition"]:
            for step in steps(key):
                uses[step] = uses.get(step, 0) + 1
        assert all(uses.get(step, 0) >= least for key in evals["composition"] for step in steps(key))
    with pytest.raises(ValueError, match="min_train_uses=50"):
        generated_split(min_train_uses=50)


def test_hold_out_keeps_each_step_in_the_keys_left():
    from comlrl.tasks.code.generated import hold_out

    keys = ["list:a:x", "list:a:y", "list:b:x", "list:b:y", "list:c:z"]
    assert hold_out(keys, 5, 1) == ["list:a:x", "list:b:y"]   # then a, b, x and y are each down to one
    assert hold_out(keys, 1, 1) == ["list:a:x"] and hold_out(keys, 5, 0) == keys
    with pytest.raises(ValueError, match="must be >= 0"):
        hold_out(keys, -1, 1)
    with pytest.raises(ValueError, match="min_train_uses must be >= 0"):
        generated_split(min_train_uses=-1)
