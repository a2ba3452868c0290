"""Rollout backends: how the agents sample their completions.

Every backend implements :class:`RolloutBackend`; the trainer picks one from
``rollout_backend`` with :func:`make_backend`. Whatever the backend, rows come back prompt-major
(row ``g * K + k`` is completion k of prompt g) with the same masks, so nothing downstream knows
which one sampled.
"""

from __future__ import annotations

from .._imports import require_torch

require_torch("comlrl.rollout")  # before the first torch import: say how to install it

from typing import Any, Optional, Protocol, Sequence

import torch

from .sampling import Rollout, SamplingParams, derive_seed, left_pad, row_uniforms, sample_tokens

__all__ = ["RolloutBackend", "Rollout", "SamplingParams", "make_backend", "derive_seed", "left_pad", "row_uniforms",
           "sample_tokens"]


class RolloutBackend(Protocol):
    """What the trainer asks of a rollout backend."""

    def sample(self, prompts: Sequence[Sequence[str]], seeds: Sequence[Sequence[Sequence[int]]],
               params: SamplingParams, eos_token_ids: Sequence[Sequence[int]],
               add_special_tokens: Sequence[bool]) -> list[Rollout]:
        """One turn of every agent: ``prompts[a]`` holds agent a's G prompt strings, ``seeds[a]``
        its ``[G][K]`` per-completion seeds. Returns one :class:`Rollout` (``G * K`` rows) per agent."""

    def mark_stale(self, agents: Optional[Sequence[int]] = None) -> None:
        """The agents' weights changed (an optimizer step, a resume): refresh any copy of them."""

    def close(self) -> None:
        """Release engines, threads and files; the backend is not used afterwards."""


def make_backend(name: str, models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], *, seed: int = 0,
                 world_size: int = 1, vllm_options: Optional[dict[str, Any]] = None,
                 compute_dtype: Optional[torch.dtype] = None) -> RolloutBackend:
    """The backend ``rollout_backend=name`` selects (``auto``, ``hf``, ``generate`` or ``vllm``);
    ``compute_dtype`` (mixed precision): the in-process backend samples with copies of the weights
    in that dtype (:mod:`comlrl.rollout.compute`; vLLM engines take the dtype from ``vllm_options``)."""
    if name == "vllm":
        from ..adapters import AdapterAgent
        from ..exceptions import ConfigError
        from .vllm import VLLMRollout

        if world_size > 1:
            raise ConfigError(f"rollout_backend='vllm' runs in one process for now, not {world_size} (torchrun); "
                              "launch without torchrun, or use rollout_backend='auto'.")
        if any(isinstance(m, AdapterAgent) for m in models):
            raise ConfigError("rollout_backend='vllm' does not serve LoRA agents yet (they would need vLLM's "
                              "multi-LoRA engine); use rollout_backend='auto', or train full models.")
        return VLLMRollout(models, tokenizers, seed=seed, **(vllm_options or {}))
    from .transformers_loop import TransformersRollout

    return TransformersRollout(models, tokenizers, name, compute_dtype=compute_dtype)
