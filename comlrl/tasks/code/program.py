"""Reading model completions as code: functions found by parsing (not by regular expressions),
the joint program of helper + main, and the structure checks of the code-collaboration reward."""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .data import tests_for

__all__ = ["extract_function", "extract_imports", "prompt_context", "joint_program", "check_item", "joint_checks",
           "Structure", "structure"]

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.S)


def _parse(text: str) -> Optional[ast.Module]:
    """``text``'s syntax tree, or None when it does not parse. Not only SyntaxError: a deeply
    nested expression raises RecursionError, a deep lambda MemoryError, a NUL byte ValueError;
    none of them may reach the trainer."""
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _code_text(completion: str) -> str:
    """The code of a completion: the fenced blocks if it has any, else all of it."""
    blocks = _FENCE.findall(completion or "")
    return "\n".join(blocks) if blocks else (completion or "")


def _blocks(text: str, start: re.Pattern) -> list[str]:
    """Each run of lines that begins with a line matching ``start`` and continues with blank or
    more-indented lines, dedented."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = start.match(lines[i])
        if not match:
            i += 1
            continue
        indent, j = len(lines[i]) - len(lines[i].lstrip()), i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        out.append(textwrap.dedent("\n".join(lines[i:j])).rstrip() + "\n")
        i = j
    return out


def extract_function(completion: str, name: str) -> Optional[str]:
    """The source of the last top-level-parsable ``def name(...)`` in ``completion`` (decorators
    dropped), or None. Text around it (explanations, markdown, examples) is ignored."""
    start = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(")
    found = None
    for block in _blocks(_code_text(completion), start):
        tree = _parse(block)
        if tree is not None and tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = block
    return found


def extract_imports(text: str) -> list[str]:
    """Top-level import lines of ``text``, in order, once each: lines that are one ``import`` or
    ``from ... import`` statement and nothing else (``import math; poly = ...`` is not kept)."""
    out = []
    for line in _code_text(text).splitlines():
        if re.match(r"^(import|from)\s+\w", line):
            tree = _parse(line)
            if tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], (ast.Import, ast.ImportFrom)):
                continue
            if line not in out:
                out.append(line)
    return out


def prompt_context(prompt: str, entry_point: str) -> str:
    """What a HumanEval prompt defines before the function to write: its imports and complete
    helper functions (e.g. ``poly`` for ``find_zero``), which the tests may call. Part of the
    program (its functions may call them) and, trusted, the tests' ``setup`` (:func:`check_item`)."""
    head = re.split(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, maxsplit=1, flags=re.M)[0]
    tree = _parse(head)
    if tree is None:
        return "\n".join(extract_imports(prompt)) + "\n"
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
    return "".join(ast.get_source_segment(head, n) + "\n\n" for n in keep)


def joint_program(prompt: str, entry_point: str, main: str, helper: str = "", helper_name: str = "aux") -> str:
    """The program to test: the prompt's context, the imports of both completions, the helper
    function (if found), then the main function (the one named ``entry_point``; the whole
    completion when none is found, so its syntax error or missing function shows in the tests)."""
    parts = [prompt_context(prompt, entry_point)]
    imports = extract_imports(helper) + [i for i in extract_imports(main) if i not in extract_imports(helper)]
    if imports:
        parts.append("\n".join(imports) + "\n\n")
    helper_code = extract_function(helper, helper_name) if helper else None
    if helper_code:
        parts.append(helper_code + "\n\n")
    parts.append(extract_function(main, entry_point) or _code_text(main))
    return "".join(parts)


def check_item(program: str, tests: list[str], prompt: str, entry_point: str, helper_name: str = "aux") -> tuple:
    """``(program, tests, setup, exports)`` for :meth:`comlrl.sandbox.Sandbox.check_many`. The
    tests see only the program's ``entry_point`` and helper; the prompt's own helper functions
    (``poly``, ``encode_cyclic``, ...), which tests call to check an answer, are defined in the judge
    from the prompt (``setup``), so the program cannot replace them (a helper rebinding ``poly``
    to ``lambda xs, x: 0.0`` passes HumanEval/32's tests otherwise)."""
    return program, tests, prompt_context(prompt, entry_point), (entry_point, helper_name)


def joint_checks(row: Mapping[str, Any], helpers: Sequence[str], mains: Sequence[str],
                 helper_name: str = "aux") -> list[tuple[str, tuple]]:
    """``(program, check item)`` of each joint answer ``(helpers[i], mains[i])`` to the task's
    ``row`` (its ``prompt``, ``entry_point`` and ``test``): the one path from a row and completions
    to what the sandbox checks, shared by the rewards, the feedback and the eval logger. Pass
    empty helpers for one agent."""
    if len(helpers) != len(mains):
        raise ValueError(f"joint_checks got {len(helpers)} helpers for {len(mains)} main functions.")
    prompt, entry = str(row["prompt"]), str(row["entry_point"])
    tests = tests_for(row)
    out = []
    for helper, main in zip(helpers, mains):
        program = joint_program(prompt, entry, main, helper, helper_name)
        out.append((program, check_item(program, tests, prompt, entry, helper_name)))
    return out


@dataclass(frozen=True)
class Structure:
    """What the code-collaboration reward credits before running anything."""

    helper_defined: bool   # `def aux(...)` with a `return <value>` in completion 1
    main_defined: bool     # `def <entry_point>(...)` with a `return <value>` in completion 2
    parses: bool           # the joint program is valid Python
    calls_helper: bool     # main calls aux
    not_wrapper: bool      # main does more than `return aux(...)` / `r = aux(...); return r`
    uses_result: bool      # no call of aux in main discards its result (a bare `aux(...)` statement)


def _function_node(source: Optional[str]) -> Optional[ast.FunctionDef]:
    tree = _parse(source) if source else None
    if tree is None or not tree.body:
        return None
    node = tree.body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _own_nodes(func: ast.AST):
    """Nodes of ``func``'s body, not of functions or classes nested in it."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _returns_value(func: Optional[ast.AST]) -> bool:
    return func is not None and any(isinstance(n, ast.Return) and n.value is not None and not (
        isinstance(n.value, ast.Constant) and n.value.value is None) for n in _own_nodes(func))


def _is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _is_wrapper(func: ast.AST, name: str) -> bool:
    body = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
            and not isinstance(s, ast.Pass)]
    if len(body) == 1:
        return isinstance(body[0], ast.Return) and _is_call_to(body[0].value, name)
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        target = body[0].targets[0] if len(body[0].targets) == 1 else None
        return (isinstance(target, ast.Name) and _is_call_to(body[0].value, name)
                and isinstance(body[1].value, ast.Name) and body[1].value.id == target.id)
    return not body


def structure(helper: str, main: str, entry_point: str, program: str, helper_name: str = "aux") -> Structure:
    """The structure checks of a joint answer (see :class:`Structure`)."""
    helper_node = _function_node(extract_function(helper, helper_name)) if helper else None
    main_node = _function_node(extract_function(main, entry_point))
    parses = _parse(program) is not None
    calls = [n for n in _own_nodes(main_node) if _is_call_to(n, helper_name)] if main_node else []
    discarded = [n for n in _own_nodes(main_node) if isinstance(n, ast.Expr) and _is_call_to(n.value, helper_name)] \
        if main_node else []
    return Structure(helper_defined=_returns_value(helper_node), main_defined=_returns_value(main_node),
                     parses=parses, calls_helper=bool(calls),
                     not_wrapper=main_node is not None and not _is_wrapper(main_node, helper_name),
                     uses_result=not discarded)
