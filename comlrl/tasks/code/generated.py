"""A seeded family of small code problems in HumanEval's format, each made of two steps so the
helper ``aux`` has a real job: ``aux`` does the first step, the entry point calls it and does the
second (docs/code.md, "A generated task").

    from comlrl.tasks.code import generated_split

    train, evals = generated_split(seed=0)      # datasets.Dataset each, columns GENERATED_COLUMNS

Every problem is a *composition*: a first step that turns a list of integers into a list (``keep
only the even numbers``, ``double every number``, ...) or a string into a string (``reverse it``,
``remove the vowels``, ...), then a second step that turns that into the answer (``return their
sum``, ``return how many vowels it has``, ...). No step names a constant to copy (a threshold, a letter).
Rows carry the usual HumanEval columns (``prompt`` with signature, docstring and one example;
``entry_point``; ``test`` with a ``check(candidate)`` of several asserts; ``canonical_solution``)
and the two parts of the reference answer, ``aux_solution`` and ``main_solution``. The eval split
holds compositions that no train row has (each composition is in one split only), each of whose
steps train compositions use, so it measures composing what was learnt, not what was seen.
Compositions whose first step does not change the answer on the tests are left out.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["generated_rows", "generated_split", "GENERATED_COLUMNS", "ENTRY_POINT", "compositions", "hold_out"]

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


# Every step is said in words without a number or a letter to copy ("keep only the positive
# numbers", not "keep only the numbers greater than 3"): measured on the small code model, a step
# with a constant was wrong on held-out problems in the same way in every sample (it wrote the
# constant of a composition it had seen), which is no lesson RL can learn from other problems.
_VOWELS = "aeiou"


def _list_firsts() -> list[_Step]:
    return [_Step("even", "keep only the even numbers", "[x for x in numbers if x % 2 == 0]",
                  lambda v: [x for x in v if x % 2 == 0], "evens"),
            _Step("odd", "keep only the odd numbers", "[x for x in numbers if x % 2 == 1]",
                  lambda v: [x for x in v if x % 2 == 1], "odds"),
            _Step("positive", "keep only the positive numbers", "[x for x in numbers if x > 0]",
                  lambda v: [x for x in v if x > 0], "positives"),
            _Step("negative", "keep only the negative numbers", "[x for x in numbers if x < 0]",
                  lambda v: [x for x in v if x < 0], "negatives"),
            _Step("nonzero", "remove the zeros", "[x for x in numbers if x != 0]",
                  lambda v: [x for x in v if x != 0], "nonzeros"),
            _Step("square", "square every number", "[x * x for x in numbers]", lambda v: [x * x for x in v],
                  "squares"),
            _Step("abs", "take the absolute value of every number", "[abs(x) for x in numbers]",
                  lambda v: [abs(x) for x in v], "absolutes"),
            _Step("double", "double every number", "[x * 2 for x in numbers]", lambda v: [x * 2 for x in v],
                  "doubled"),
            _Step("triple", "triple every number", "[x * 3 for x in numbers]", lambda v: [x * 3 for x in v],
                  "tripled"),
            _Step("negate", "negate every number", "[-x for x in numbers]", lambda v: [-x for x in v], "negated"),
            _Step("inc", "add one to every number", "[x + 1 for x in numbers]", lambda v: [x + 1 for x in v],
                  "incremented"),
            _Step("dec", "subtract one from every number", "[x - 1 for x in numbers]",
                  lambda v: [x - 1 for x in v], "decremented"),
            _Step("halve", "halve every number, rounding down", "[x // 2 for x in numbers]",
                  lambda v: [x // 2 for x in v], "halved"),
            _Step("reverse", "reverse the list", "numbers[::-1]", lambda v: v[::-1], "reversed"),
            _Step("sort", "sort the numbers from smallest to largest", "sorted(numbers)", sorted, "sorted"),
            _Step("sortdesc", "sort the numbers from largest to smallest", "sorted(numbers, reverse=True)",
                  lambda v: sorted(v, reverse=True), "sorted_down"),
            _Step("dedupe", "remove repeated numbers, keeping the first of each", "list(dict.fromkeys(numbers))",
                  lambda v: list(dict.fromkeys(v)), "distinct"),
            _Step("alternate", "keep every other number, starting with the first", "numbers[::2]",
                  lambda v: v[::2], "alternate"),
            _Step("dropfirst", "drop the first number", "numbers[1:]", lambda v: v[1:], "rest"),
            _Step("droplast", "drop the last number", "numbers[:-1]", lambda v: v[:-1], "init")]


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


def _string_firsts() -> list[_Step]:
    return [_Step("upper", "change it to upper case", "text.upper()", str.upper, "upper"),
            _Step("reverse", "reverse it", "text[::-1]", lambda s: s[::-1], "reversed"),
            _Step("nospace", "remove the spaces", "text.replace(' ', '')", lambda s: s.replace(" ", ""),
                  "unspaced"),
            _Step("title", "capitalize every word", "text.title()", str.title, "titled"),
            _Step("novowels", "remove the vowels", f"''.join(c for c in text if c not in '{_VOWELS}')",
                  lambda s: "".join(c for c in s if c not in _VOWELS), "consonants"),
            _Step("vowels", "keep only the vowels", f"''.join(c for c in text if c in '{_VOWELS}')",
                  lambda s: "".join(c for c in s if c in _VOWELS), "vowels"),
            _Step("revwords", "reverse the order of the words", "' '.join(text.split()[::-1])",
                  lambda s: " ".join(s.split()[::-1]), "words_reversed"),
            _Step("sortwords", "sort the words alphabetically", "' '.join(sorted(text.split()))",
                  lambda s: " ".join(sorted(s.split())), "words_sorted"),
            _Step("doubled", "double every character", "''.join(c * 2 for c in text)",
                  lambda s: "".join(c * 2 for c in s), "doubled")]


def _string_seconds() -> list[_Step]:
    return [_Step("len", "return its length", "len(values)", len, "length"),
            _Step("words", "return how many words it has", "len(values.split())", lambda s: len(s.split()),
                  "word_count"),
            _Step("head", "return its first character, or '' if it is empty", "values[:1]", lambda s: s[:1],
                  "first_char"),
            _Step("tail", "return its last character, or '' if it is empty", "values[-1:]", lambda s: s[-1:],
                  "last_char"),
            _Step("nvowels", "return how many vowels it has", f"sum(c in '{_VOWELS}' for c in values)",
                  lambda s: sum(c in _VOWELS for c in s), "vowel_count"),
            _Step("nspaces", "return how many spaces it has", "values.count(' ')", lambda s: s.count(" "),
                  "space_count"),
            _Step("ncapitals", "return how many capital letters it has", "sum(c.isupper() for c in values)",
                  lambda s: sum(c.isupper() for c in s), "capital_count"),
            _Step("distinct", "return how many different characters it has", "len(set(values))",
                  lambda s: len(set(s)), "distinct_chars")]


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


def hold_out(keys: list[str], count: int, keep: int) -> list[str]:
    """Up to ``count`` composition keys (``kind:first:second``), taken greedily in ``keys``' order,
    each skipped unless both its steps stay in more than ``keep`` of the keys left; fewer when the
    order runs out. Deterministic for the same ``keys``: :func:`generated_split` holds out its eval
    compositions with it, so that every step a held-out problem uses is in train compositions."""
    if count < 0 or keep < 0:
        raise ValueError(f"count and keep must be >= 0, got {count} and {keep}.")

    def steps(key: str) -> tuple[tuple[str, str], tuple[str, str]]:
        kind, first, second = key.split(":")
        return (kind, "first:" + first), (kind, "second:" + second)

    uses: dict[tuple[str, str], int] = {}
    for key in keys:
        for step in steps(key):
            uses[step] = uses.get(step, 0) + 1
    out: list[str] = []
    for key in keys:
        if len(out) == count:
            break
        if all(uses[step] > keep for step in steps(key)):
            out.append(key)
            for step in steps(key):
                uses[step] -= 1
    return out


def generated_split(eval_size: int = 48, seed: int = 0, rows_per_composition: int = 1, tests: int = 5,
                    eval_rows_per_composition: int = 1, min_train_uses: int = 2) -> tuple[Any, Any]:
    """``(train, eval)`` as ``datasets.Dataset``: ``eval_size`` compositions held out for evaluation
    (``eval_rows_per_composition`` rows each), the others for training (``rows_per_composition`` rows
    each). No composition is in both. The held-out ones are taken in :func:`generated_rows`'s order,
    skipping any whose first or second step would then be used by fewer than ``min_train_uses``
    train compositions (:func:`hold_out`): a held-out problem is a new composition of steps the
    train split teaches, never a step it has no example of."""
    from datasets import Dataset

    rows = generated_rows(seed, max(rows_per_composition, eval_rows_per_composition), tests)
    keys = list(dict.fromkeys(r["composition"] for r in rows))
    if not 0 < eval_size < len(keys):
        raise ValueError(f"eval_size={eval_size} must leave both parts non-empty: 1..{len(keys) - 1} compositions.")
    if min_train_uses < 0:
        raise ValueError(f"min_train_uses must be >= 0, got {min_train_uses}.")
    held = set(hold_out(keys, eval_size, min_train_uses))
    if len(held) < eval_size:
        raise ValueError(f"eval_size={eval_size} is too large for min_train_uses={min_train_uses}: taking "
                         f"compositions in order, only {len(held)} could be held out with each of their steps kept in "
                         f"{min_train_uses} train compositions; lower one of them.")
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
