"""Prompt formatters (CoMLRL's helper); see :mod:`comlrl.engine.prompts` for the conventions."""

from __future__ import annotations

from typing import Callable, Sequence, Union

from ..engine.prompts import Formatter, build_formatter_list

__all__ = ["build_formatters", "Formatter"]


def build_formatters(formatters: Union[None, Callable, Sequence[Callable]], num_agents: int, *,
                     pass_none_external_prompts: bool = True) -> list[Formatter]:
    """One formatter per agent, each ``f(item, external_prompts=None) -> prompt``.

    None gives the default (``item["prompt"]``, or the external prompt when given); one callable is
    shared; a list must have ``num_agents`` entries. A formatter that declares ``external_prompts``
    receives it, also when it is None if ``pass_none_external_prompts``; others get ``f(item)``.
    """
    return build_formatter_list(formatters, num_agents, pass_none=pass_none_external_prompts)
