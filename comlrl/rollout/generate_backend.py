"""Sampling through the model's own ``generate()`` (transformers' ``GenerationMixin`` or a
user's replacement), for models our samplers must not bypass.

Each agent's prompts go to ``generate`` in one left-padded batch with
``num_return_sequences=K``; rows come back prompt-major, as every backend returns them. The
random stream is torch's global one, forked and seeded from the batch's row seeds, so a run is
reproducible from its seed, but unlike :mod:`comlrl.rollout.transformers_loop` a completion
depends on which other prompts share its batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..functional.losses import completion_mask
from .sampling import Rollout, SamplingParams, decode_completions, derive_seed, left_pad  # one decoding rule

__all__ = ["generate_rollout", "has_custom_generate"]


def has_custom_generate(model: torch.nn.Module) -> bool:
    """True if ``generate`` was replaced on this model object (a stub, a wrapper, a custom
    decoder): then ``rollout_backend="auto"`` samples through it rather than around it."""
    return "generate" in getattr(model, "__dict__", {})


def generate_rollout(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str],
                     seeds: Sequence[Sequence[int]], params: SamplingParams, eos_token_ids: Sequence[int],
                     add_special_tokens: bool) -> Rollout:
    """Sample ``K = len(seeds[g])`` completions per prompt with ``model.generate``.

    Returns:
        A :class:`Rollout` with ``R = G * K`` rows, prompt-major; completions right-padded with
        the pad token after each row's first EOS.
    """
    device = next(model.parameters()).device
    group = len(seeds[0])
    encoded = tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]
    prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id, device)
    kwargs = dict(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                  max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                  top_k=params.top_k or 0, num_return_sequences=group, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=list(eos_token_ids), return_dict_in_generate=True)
    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(derive_seed("generate", *[s for row in seeds for s in row]))
            out = model.generate(**kwargs)
    finally:
        model.train(was_training)
    sequences = getattr(out, "sequences", out)
    completion_ids = _pad_after_eos(sequences[:, prompt_ids.shape[1]:].to(device).clone(), eos_token_ids,
                                    tokenizer.pad_token_id)
    mask = completion_mask(completion_ids, eos_token_ids)

    texts = decode_completions(tokenizer, completion_ids, mask, eos_token_ids)
    rows = torch.arange(len(prompts), device=device).repeat_interleave(group)
    return Rollout(prompt_ids[rows], prompt_mask[rows], completion_ids, mask, rows, texts)


def _pad_after_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int], pad_token_id: int) -> torch.Tensor:
    """Whatever ``generate`` put after a row's first EOS becomes padding."""
    keep = completion_mask(completion_ids, eos_token_ids)
    return completion_ids.masked_fill(~keep, pad_token_id)
