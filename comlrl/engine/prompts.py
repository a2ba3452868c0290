"""Prompts: formatters turn dataset rows (and later turns' external prompts) into each agent's
prompt, checked once; chat prompts are rendered with the agent's chat template.

Formatter conventions are CoMLRL's: ``f(item) -> str``, optionally with an ``external_prompts``
keyword that receives the prompt an external transition produced for a later turn. Without a
formatter an agent is prompted with ``item["prompt"]``. A formatter may also return chat messages
(``[{"role": ..., "content": ...}, ...]``), rendered with the agent's chat template.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..exceptions import ConfigError, DataError, TokenizerError

__all__ = ["Formatter", "build_formatter_list", "PromptTable", "check_prompt", "render_prompt", "dataset_rows"]

Prompt = Union[str, list[dict[str, Any]]]


def _accepts_external(func: Callable) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "external_prompts" and p.kind is not p.POSITIONAL_ONLY or p.kind is p.VAR_KEYWORD
               for p in params)


class Formatter:
    """One agent's formatter: ``formatter(item, external_prompts=None) -> prompt``.

    Args:
        func: the user's formatter, or None for the default (``item["prompt"]``, or the external
            prompt when one is given).
        pass_none: call a user formatter that takes ``external_prompts`` with ``None`` on the first
            turn too (False: only pass it when there is one).
    """

    def __init__(self, func: Optional[Callable] = None, pass_none: bool = False):
        if func is not None and not callable(func):
            raise ConfigError(f"a formatter must be callable (item -> prompt), got {type(func).__name__}.")
        self.func, self.pass_none = func, pass_none
        self.takes_external = func is not None and _accepts_external(func)

    @property
    def source(self) -> Optional[Callable]:
        """The user's callable (what fingerprints and checkpoints describe)."""
        return self.func

    def __call__(self, item: Mapping[str, Any], external_prompts: Optional[str] = None) -> Any:
        if self.func is None:
            return external_prompts if external_prompts is not None else item.get("prompt", "")
        if self.takes_external and (external_prompts is not None or self.pass_none):
            return self.func(item, external_prompts=external_prompts)
        return self.func(item)


def build_formatter_list(formatters: Union[None, Callable, Sequence[Callable]], count: int,
                         pass_none: bool = False) -> list[Formatter]:
    """One :class:`Formatter` per agent from None, one callable, or a list of ``count``."""
    if formatters is None or callable(formatters):
        return [Formatter(formatters, pass_none) for _ in range(count)]
    if isinstance(formatters, (str, bytes)) or not isinstance(formatters, Sequence):
        raise ConfigError(f"formatters must be a callable or a list of {count} callables, got "
                          f"{type(formatters).__name__}.")
    if len(formatters) != count:
        raise ConfigError(f"formatters has {len(formatters)} entries for {count} agents; pass one callable for "
                          f"all or exactly one per agent.")
    return [Formatter(f, pass_none) for f in formatters]


def check_prompt(prompt: Any, agent: int, where: str, hint: str) -> Prompt:
    """A prompt as text or chat messages, or a DataError naming the agent and row."""
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return [dict(m) for m in prompt]
    if not isinstance(prompt, str):
        raise DataError(f"the prompt of agent {agent} for {where} is a {type(prompt).__name__}, neither a string "
                        f"nor chat messages [{{'role': ..., 'content': ...}}]: {prompt!r:.80}. {hint}")
    if not prompt:
        raise DataError(f"the prompt of agent {agent} for {where} is empty; every prompt needs text. {hint}")
    return prompt


def render_prompt(tokenizer: Any, prompt: Prompt, chat: bool) -> str:
    """The text an agent samples from: chat messages (or a later turn's text, as one user message)
    rendered with the tokenizer's chat template, ending with the assistant's turn."""
    if not chat:
        return prompt  # type: ignore[return-value]
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("the prompts are chat messages but the agent's tokenizer has no chat_template; pass "
                             "plain-string prompts or a tokenizer with a chat template.")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def dataset_rows(dataset: Any, name: str) -> list[dict[str, Any]]:
    """A dataset (``datasets.Dataset``, list of dicts, any iterable of mappings) as a list of dicts."""
    try:
        rows = [dict(r) for r in dataset]
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} must be a datasets.Dataset or a list of dicts; iterating it failed: {exc}") from None
    if not rows:
        raise DataError(f"{name} is empty; it needs at least one row.")
    return rows


def _copy(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of a row that user code may change freely (a deep one where the values allow)."""
    try:
        return copy.deepcopy(row)
    except Exception:  # noqa: BLE001 - a value that cannot be copied (a handle): copy the row itself
        return dict(row)


@dataclass(frozen=True)
class PromptTable:
    """A dataset with every agent's first-turn prompt formatted and checked.

    ``prompts[a][i]`` is agent a's prompt for ``rows[i]``; ``chat[a]`` says whether agent a's
    prompts are chat messages; ``fingerprint`` is the rows' digest, taken before any user code saw
    them. User code (formatters, rewards, transitions, callbacks) gets copies (:meth:`item`), so a
    function that annotates its row (a memo field) changes neither the table nor the fingerprint.
    """

    rows: tuple[dict[str, Any], ...]
    prompts: tuple[tuple[Prompt, ...], ...]   # [num_agents][len(rows)]
    chat: tuple[bool, ...]                     # [num_agents]
    fingerprint: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    def item(self, index: int) -> dict[str, Any]:
        """Row ``index`` as user code gets it: a copy."""
        return _copy(self.rows[index])

    @classmethod
    def build(cls, dataset: Any, name: str, formatters: Sequence[Formatter]) -> "PromptTable":
        from ..checkpoint.fingerprint import dataset_fingerprint

        rows = dataset_rows(dataset, name)
        fingerprint = dataset_fingerprint(rows)
        prompts, chat = [], []
        for a, formatter in enumerate(formatters):
            agent_prompts = []
            for i, row in enumerate(rows):
                hint = "Fix the 'prompt' column." if formatter.func is None else "Make the formatter return text."
                if formatter.func is None and "prompt" not in row:
                    raise DataError(f"{name} row {i} has no 'prompt' column (columns: {sorted(row)}); add one, or "
                                    "pass formatters=... that build the prompt.")
                try:
                    value = formatter(_copy(row))
                except Exception as exc:
                    raise DataError(f"formatter of agent {a} failed on {name} row {i}: "
                                    f"{type(exc).__name__}: {exc}") from exc
                agent_prompts.append(check_prompt(value, a, f"{name} row {i}", hint))
            kinds = {isinstance(p, list) for p in agent_prompts}
            if len(kinds) > 1:
                raise DataError(f"agent {a} gets plain-string prompts for some rows of {name} and chat messages for "
                                "others; use one form for the whole dataset.")
            prompts.append(tuple(agent_prompts))
            chat.append(kinds == {True})
        return cls(tuple(rows), tuple(prompts), tuple(chat), fingerprint)
