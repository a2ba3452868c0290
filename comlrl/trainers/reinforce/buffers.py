"""What the REINFORCE family keeps of a played buffer (``PlayedBuffer.data``) and of an optimizer
step that updates the agents one after another (``PlayedBuffer.step_parts``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["GroupBufferData", "SequentialStepParts"]


@dataclass
class GroupBufferData:
    """``PlayedBuffer.data`` of MAGRPO and the families built on it (its variants, MAHAGRPO,
    centralised MAGRPO, Dr. GRPO).

    ``returns``: ``[turn][agent] -> [nodes_t * K]`` float64, each agent's return of each of its
    completions (node-major), set by ``collect``. With the clipped-ratio update, filled during the
    buffer's optimizer steps: ``old_log_probs``, ``(agent, step start) -> [R, T]`` the sampling
    policy's log-probs of the agent's rows of the optimizer step whose prompts start at ``step
    start`` (``groups.start``); ``sampled_policy_read``, the agents whose old log-probs of every
    step of the buffer have been taken."""

    returns: list[list[torch.Tensor]]
    old_log_probs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    sampled_policy_read: set[int] = field(default_factory=set)


@dataclass
class SequentialStepParts:
    """``PlayedBuffer.step_parts`` of a MAHAGRPO optimizer step: what it finished, by position in
    the step's update order. ``updates``: position -> that agent's update metrics; ``weights``:
    position -> ``[R]`` the advantage weights M after that agent's ratio (the product of the
    clipped ratios of the agents up to it; None when this process has no rows)."""

    updates: dict[int, dict[str, float]] = field(default_factory=dict)
    weights: dict[int, Optional[torch.Tensor]] = field(default_factory=dict)
