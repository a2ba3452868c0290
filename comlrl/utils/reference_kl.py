"""Reference-policy KL helpers (CoMLRL's names).

comlrl's trainers penalise each completion's return by ``reference_kl_coef`` times the sum, over
its tokens, of the k3 estimate of KL(policy || reference), the reference being the agent's frozen
initial policy (see :func:`comlrl.functional.losses.sequence_kl`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence

import torch

from ..exceptions import ConfigError
from ..functional.logprobs import selected_log_probs
from ..engine.devices import DeviceScheduler
from .model_loading import freeze_model

__all__ = ["reference_kl_enabled", "reference_kl_coef", "validate_reference_kl_config", "resolve_reference_devices",
           "clone_reference_models", "load_reference_models_from_sources", "response_token_logprobs",
           "reference_kl_for_sequence"]


def reference_kl_enabled(args: Any) -> bool:
    return bool(getattr(args, "reference_kl_enabled", False))


def reference_kl_coef(args: Any) -> float:
    return float(getattr(args, "reference_kl_coef", 0.1))


def validate_reference_kl_config(args: Any, expected_count: int) -> None:
    """The coefficient is >= 0 and, when enabled, ``reference_devices`` fits ``expected_count`` models."""
    if reference_kl_coef(args) < 0:
        raise ConfigError(f"reference_kl_coef must be >= 0, got {reference_kl_coef(args)}.")
    if reference_kl_enabled(args) and getattr(args, "reference_devices", None) is not None:
        DeviceScheduler.resolve_devices(args.reference_devices, expected_count, kind="reference_devices")


def resolve_reference_devices(args: Any, fallback_devices: Sequence[torch.device], expected_count: int
                              ) -> list[torch.device]:
    """``reference_devices``, or the fallback (the agents' devices) when unset."""
    spec = getattr(args, "reference_devices", None)
    if spec is None:
        return list(fallback_devices)
    return DeviceScheduler.resolve_devices(spec, expected_count, kind="reference_devices")


def clone_reference_models(policy_models: Sequence[torch.nn.Module], *, devices: Sequence[torch.device]
                           ) -> list[torch.nn.Module]:
    """Frozen deep copies of the policies, one per device."""
    return [freeze_model(copy.deepcopy(m).to(d)) for m, d in zip(policy_models, devices)]


def load_reference_models_from_sources(model_sources: Sequence[str], *, devices: Sequence[torch.device],
                                       model_kwargs: Optional[Mapping[str, Any]] = None) -> list[torch.nn.Module]:
    """Frozen models loaded by name (``from_pretrained(source, **model_kwargs)``), one per device."""
    from transformers import AutoModelForCausalLM

    from ..engine.hub import load_pretrained

    kwargs = dict(model_kwargs or {})
    return [freeze_model(load_pretrained(AutoModelForCausalLM, s, "reference model", **kwargs).to(d))
            for s, d in zip(model_sources, devices)]


def response_token_logprobs(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                            prompt_len: int, response_len: int) -> torch.Tensor:
    """``[B, response_len]`` log-probs of the tokens after ``prompt_len`` in ``sequences`` ``[B, L]``."""
    device = next(model.parameters()).device
    logits = model(input_ids=sequences.to(device), attention_mask=attention_mask.to(device)).logits
    predicted = logits[:, prompt_len - 1:prompt_len - 1 + response_len]
    return selected_log_probs(predicted, sequences[:, prompt_len:prompt_len + response_len].to(device))


def reference_kl_for_sequence(policy_model: torch.nn.Module, reference_model: torch.nn.Module,
                              sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                              response_len: int) -> torch.Tensor:
    """``[B]`` (CPU) sum over the response tokens of the k3 KL estimate between the policy and the
    reference, without gradients, both models in eval mode (restored afterwards)."""
    modes = (policy_model.training, reference_model.training)
    policy_model.eval(), reference_model.eval()
    try:
        with torch.no_grad():
            policy = response_token_logprobs(policy_model, sequences, attention_mask, prompt_len, response_len)
            reference = response_token_logprobs(reference_model, sequences, attention_mask, prompt_len, response_len)
    finally:
        policy_model.train(modes[0]), reference_model.train(modes[1])
    delta = reference.double().cpu() - policy.double().cpu()
    return (torch.exp(delta) - delta - 1.0).sum(dim=1)
