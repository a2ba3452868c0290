"""A seeded family of small code problems in HumanEval's format, each made of two steps so the
helper ``aux`` has a real job: ``aux`` does the first step, the entry point calls it and does the
second (docs/code.md, "A generated task").

    from comlrl.tasks.code import generated_split

    train, evals = generated_split(seed=0)      # datasets.Dataset each, columns GENERATED_COLUMNS

Every problem is a *composition*: a first step that turns a list of integers into a list (``keep
only the even numbers``, ``add 3 to every number``, ...) or a string into a string (``reverse it``,
``remove every 'a'``, ...), then a second step that turns that into the answer (``return their
sum``, ``return how many times 'e' occurs in it``, ...). Rows carry the usual HumanEval columns
(``prompt`` with signature, docstring and one example; ``entry_point``; ``test`` with a
``check(candidate)`` of several asserts; ``canonical_solution``) and the two parts of the reference
answer, ``aux_solution`` and ``main_solution``. The eval split holds compositions that no train row
has (each composition is in one split only), so it measures what was learnt, not what was seen.
Compositions whose first step does not change the answer on the tests are left out.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["generated_rows", "generated_split", "GENERATED_COLUMNS", "ENTRY_POINT", "compositions"]

# Every problem's entry point: what tells problems apart is the docstring, so a small model does
# not have to copy a long made-up name (``count_a_to_o``) from the prompt to score at all.
ENTRY_POINT = "solve"

GENERATED_COLUMNS = ("task_id", "prompt", "entry_point", "test", "canonical_solution", "aux_solution",
                     "main_solution", "composition")


@dataclass(frozen=True)
class _Step:
    key: str          # unique, part of the composition's key
    words: str        # what the docstring says
    code: str         # the expression, over `numbers` / `text` (first steps) or `values` (second steps)
    fn: Callable[[Any], Any]
    name: str         # part of the entry point's name


def _list_firsts() -> list[_Step]:
    steps = [_Step("even", "keep only the even numbers", "[x for x in numbers if x % 2 == 0]",
                   lambda v: [x for x in v if x % 2 == 0], "evens"),
             _Step("odd", "keep only the odd numbers", "[x for x in numbers if x % 2 == 1]",
                   lambda v: [x for x in v if x % 2 == 1], "odds"),
             _Step("square", "square every number", "[x * x for x in numbers]", lambda v: [x * x for x in v],
                   "squares"),
             _Step("abs", "take the absolute value of every number", "[abs(x) for x in numbers]",
                   lambda v: [abs(x) for x in v], "absolutes"),
             _Step("reverse", "reverse the list", "numbers[::-1]", lambda v: v[::-1], "reversed"),
             _Step("sort", "sort the numbers from smallest to largest", "sorted(numbers)", sorted, "sorted")]
    for k in range(1, 6):
        steps += [_Step(f"gt{k}", f"keep only the numbers greater than {k}", f"[x for x in numbers if x > {k}]",
                        lambda v, k=k: [x for x in v if x > k], f"above_{k}"),
                  _Step(f"lt{k}", f"keep only the numbers less than {k}", f"[x for x in numbers if x < {k}]",
                        lambda v, k=k: [x for x in v if x < k], f"below_{k}"),
                  _Step(f"add{k}", f"add {k} to every number", f"[x + {k} for x in numbers]",
                        lambda v, k=k: [x + k for x in v], f"plus_{k}")]
    for k in range(2, 5):
        steps.append(_Step(f"mul{k}", f"multiply every number by {k}", f"[x * {k} for x in numbers]",
                           lambda v, k=k: [x * k for x in v], f"times_{k}"))
    return steps


_LIST_SECONDS = [
    _Step("sum", "return their sum", "sum(values)", sum, "sum"),
    _Step("count", "return how many there are", "len(values)", len, "count"),
    _Step("max", "return the largest one, or 0 if there is none", "max(values, default=0)",
          lambda v: max(v, default=0), "max"),
    _Step("min", "return the smallest one, or 0 if there is none", "min(values, default=0)",
          lambda v: min(v, default=0), "min"),
    _Step("first", "return the first one, or 0 if there is none", "values[0] if values else 0",
          lambda v: v[0] if v else 0, "first"),
    _Step("last", "return the last one, or 0 if there is none", "values[-1] if values else 0",
          lambda v: v[-1] if v else 0, "last"),
]

_LETTERS = "aeiost"


def _string_firsts() -> list[_Step]:
    steps = [_Step("upper", "change it to upper case", "text.upper()", str.upper, "upper"),
             _Step("reverse", "reverse it", "text[::-1]", lambda s: s[::-1], "reversed"),
             _Step("nospace", "remove the spaces", "text.replace(' ', '')", lambda s: s.replace(" ", ""),
                   "unspaced"),
             _Step("title", "capitalize every word", "text.title()", str.title, "titled")]
    for c in _LETTERS:
        steps.append(_Step(f"drop{c}", f"remove every '{c}'", f"text.replace('{c}', '')",
                           lambda s, c=c: s.replace(c, ""), f"without_{c}"))
    for a, b in (("a", "o"), ("e", "i"), ("o", "a"), ("s", "z")):
        steps.append(_Step(f"swap{a}{b}", f"replace every '{a}' with '{b}'", f"text.replace('{a}', '{b}')",
                           lambda s, a=a, b=b: s.replace(a, b), f"{a}_to_{b}"))
    return steps


def _string_seconds() -> list[_Step]:
    steps = [_Step("len", "return its length", "len(values)", len, "length"),
             _Step("words", "return how many words it has", "len(values.split())", lambda s: len(s.split()),
                   "word_count"),
             _Step("head", "return its first character, or '' if it is empty", "values[:1]", lambda s: s[:1],
                   "first_char"),
             _Step("tail", "return its last character, or '' if it is empty", "values[-1:]", lambda s: s[-1:],
                   "last_char")]
    for c in _LETTERS:
        steps.append(_Step(f"count{c}", f"return how many times '{c}' occurs in it", f"values.count('{c}')",
                           lambda s, c=c: s.count(c), f"count_{c}"))
    return steps


_WORDS = ("apple", "stone", "river", "east", "toast", "moon", "sister", "idea", "oasis", "tea", "sauce", "test",
          "ocean", "island", "seat", "aside", "storm", "a", "is", "it")


def _list_input(rng: random.Random) -> list[int]:
    return [rng.randint(-5, 9) for _ in range(rng.randint(0, 6))]


def _string_input(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))


@dataclass(frozen=True)
class _Composition:
    kind: str      # "list" or "str"
    first: _Step
    second: _Step

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.first.key}:{self.second.key}"

    @property
    def name(self) -> str:
        """A readable name for the task id (the entry point itself is :data:`ENTRY_POINT`)."""
        return f"{self.second.name}_of_{self.first.name}" if self.kind == "list" else \
            f"{self.second.name}_{self.first.name}"

    def answer(self, value: Any) -> Any:
        return self.second.fn(self.first.fn(value))


def compositions() -> list[_Composition]:
    """Every composition of the family (before the redundancy check), in a fixed order."""
    out = [_Composition("list", f, s) for f in _list_firsts() for s in _LIST_SECONDS]
    out += [_Composition("str", f, s) for f in _string_firsts() for s in _string_seconds()]
    return out


def _cases(comp: _Composition, rng: random.Random, count: int) -> list[Any]:
    draw = _list_input if comp.kind == "list" else _string_input
    inputs: list[Any] = []
    for _ in range(50 * count):
        value = draw(rng)
        if value not in inputs:
            inputs.append(value)
        if len(inputs) == count:
            break
    return inputs


def _discriminating(comp: _Composition, cases: list[Any]) -> bool:
    """The first step matters (some answer differs from the second step alone) and the answer
    depends on the input (no constant passes every test)."""
    answers = [repr(comp.answer(v)) for v in cases]
    return any(a != repr(comp.second.fn(v)) for a, v in zip(answers, cases)) and len(set(answers)) > 1


def _row(comp: _Composition, rng: random.Random, tests: int, index: int) -> dict[str, Any] | None:
    """One row of ``comp``, or None when no draw of test inputs tells it from a simpler function
    (the composition is redundant: ``reverse the list, then return their sum``)."""
    for _ in range(8):
        example, *cases = _cases(comp, rng, tests + 1)
        if _discriminating(comp, cases):
            break
    else:
        return None
    arg, hint, out_hint = ("numbers", "list", "int") if comp.kind == "list" else \
        ("text", "str", "str" if comp.second.key in ("head", "tail") else "int")
    words = f"{comp.first.words[0].upper()}{comp.first.words[1:]}, then {comp.second.words}."
    prompt = (f"def {ENTRY_POINT}({arg}: {hint}) -> {out_hint}:\n"
              f'    """{words}\n'
              f"    >>> {ENTRY_POINT}({example!r})\n"
              f"    {comp.answer(example)!r}\n"
              f'    """\n')
    aux = f"def aux({arg}):\n    return {comp.first.code}\n"
    main = f"def {ENTRY_POINT}({arg}):\n    values = aux({arg})\n    return {comp.second.code}\n"
    body = f"    values = {comp.first.code}\n    return {comp.second.code}\n"
    test = "def check(candidate):\n" + "".join(f"    assert candidate({v!r}) == {comp.answer(v)!r}\n" for v in cases)
    return {"task_id": f"Generated/{comp.name}/{index}", "prompt": prompt, "entry_point": ENTRY_POINT, "test": test,
            "canonical_solution": body, "aux_solution": aux, "main_solution": main, "composition": comp.key}


def _rank(key: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def generated_rows(seed: int = 0, rows_per_composition: int = 1, tests: int = 5) -> list[dict[str, Any]]:
    """Rows of every composition (``rows_per_composition`` each, with their own example and test
    inputs), ordered by a hash of ``(seed, composition)``: the same on every machine for the same
    arguments. Each composition draws from a generator of its own seeded by ``(seed,
    composition)``, so its first rows, and which compositions there are, do not depend on
    ``rows_per_composition``."""
    if rows_per_composition < 1 or tests < 1:
        raise ValueError(f"rows_per_composition and tests must be >= 1, got {rows_per_composition} and {tests}.")
    out: list[dict[str, Any]] = []
    for comp in sorted(compositions(), key=lambda c: _rank(c.key, seed)):
        rng = random.Random(_rank(comp.key, seed))
        first = _row(comp, rng, tests, 0)
        if first is None:
            continue  # redundant: no draw tells it from its second step alone
        out.append(first)
        for k in range(1, rows_per_composition):
            row = _row(comp, rng, tests, k)
            if row is not None:
                out.append(row)
    return out


def generated_split(eval_size: int = 48, seed: int = 0, rows_per_composition: int = 1, tests: int = 5,
                    eval_rows_per_composition: int = 1) -> tuple[Any, Any]:
    """``(train, eval)`` as ``datasets.Dataset``: the first ``eval_size`` compositions of
    :func:`generated_rows`'s order for evaluation (``eval_rows_per_composition`` rows each), the
    others for training (``rows_per_composition`` rows each). No composition is in both."""
    from datasets import Dataset

    rows = generated_rows(seed, max(rows_per_composition, eval_rows_per_composition), tests)
    keys = list(dict.fromkeys(r["composition"] for r in rows))
    if not 0 < eval_size < len(keys):
        raise ValueError(f"eval_size={eval_size} must leave both parts non-empty: 1..{len(keys) - 1} compositions.")
    held = set(keys[:eval_size])
    seen: dict[str, int] = {}
    train, evals = [], []
    for r in rows:
        k = r["composition"]
        seen[k] = seen.get(k, 0) + 1
        if k in held and seen[k] <= eval_rows_per_composition:
            evals.append(r)
        elif k not in held and seen[k] <= rows_per_composition:
            train.append(r)
    return Dataset.from_list(train), Dataset.from_list(evals)
