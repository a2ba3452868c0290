"""What the actor-critic family keeps of a played buffer (``PlayedBuffer.data``): computed once,
before any update, by the advantage phase."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...rollout import Rollout

__all__ = ["ActorCriticBufferData", "MAACBufferData"]


@dataclass
class ActorCriticBufferData:
    """``PlayedBuffer.data`` of IAC: per agent and turn (``[agent][turn] -> [R_t]``, row-aligned
    with the agent's rollout of the turn, on the CPU):

    ``values``: float64, the critic's values of the sampled states (or actions) before any update;
    ``targets``: float64, one-step TD targets ``r + discount * V(next)`` of the shaped rewards;
    ``raw_advantages``: float64, ``targets - values`` (the TD errors);
    ``advantages``: float32, the raw advantages standardised per agent and turn over the buffer
    (on every process together), or as they are without ``advantage_normalization``;
    ``shaped``: float64, the rewards less the reference-KL penalty;
    ``kl``: float64, each completion's KL estimate to the agent's reference policy (each agent's
    list empty without ``reference_kl_enabled``)."""

    values: list[list[torch.Tensor]]
    targets: list[list[torch.Tensor]]
    raw_advantages: list[list[torch.Tensor]]
    advantages: list[list[torch.Tensor]]
    shaped: list[list[torch.Tensor]]
    kl: list[list[torch.Tensor]]


@dataclass
class MAACBufferData(ActorCriticBufferData):
    """``PlayedBuffer.data`` of MAAC: IAC's, and ``critic_inputs``: ``[turn]`` the centralised
    critic's left-padded token rows of the turn (one per row of the agents' rollouts)."""

    critic_inputs: list[Rollout] = field(default_factory=list)
