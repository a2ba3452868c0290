"""Token log-probabilities, completion masks and the policy-gradient loss. Pure functions.

Shapes: ``R`` rows (prompts x generations), ``P`` prompt length (left-padded), ``T`` completion
length (right-padded), ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = [
    "completion_mask",
    "selected_log_probs",
    "sequence_log_probs",
    "policy_gradient_loss",
    "aggregate_tokens",
    "kl_penalty",
]


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Iterable[int]) -> torch.Tensor:
    """Which completion tokens are scored: everything up to and including the first EOS.

    Args:
        completion_ids: ``[R, T]`` sampled token ids (anything after the first EOS is padding).
        eos_token_ids: ids that end a completion.
    Returns:
        ``[R, T]`` bool mask; a row without EOS (cut by max_new_tokens) is scored in full.
    """
    eos = torch.tensor(sorted(set(eos_token_ids)), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos).to(torch.int64)
    # Number of EOS tokens strictly before each position: 0 means "not past the first EOS".
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return eos_before == 0


def selected_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                       chunk_rows: int = 16) -> torch.Tensor:
    """log softmax(logits / temperature)[token], without materialising a second [.., V] tensor.

    Uses ``logit[token] - logsumexp(logits)``, processed ``chunk_rows`` rows at a time so that the
    extra memory stays bounded for large vocabularies.

    Args:
        logits: ``[R, T, V]``.
        tokens: ``[R, T]`` int64.
    Returns:
        ``[R, T]`` float32 log-probabilities.
    """
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        block = logits[start:start + chunk_rows].float()
        if temperature != 1.0:
            block = block / temperature
        picked = block.gather(-1, tokens[start:start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(block, dim=-1))
    return torch.cat(out, dim=0)


def sequence_log_probs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       completion_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the completion tokens under ``model``, in one padded forward pass.

    The prompt is left-padded and the completion right-padded, so the completion occupies the last
    ``T`` positions and only ``T + 1`` positions of logits are computed (``logits_to_keep``).
    Position ids follow the attention mask, exactly as during sampling.

    Args:
        prompt_ids: ``[R, P]`` left-padded prompt ids; ``prompt_mask`` ``[R, P]`` 1 for real tokens.
        completion_ids: ``[R, T]``.
    Returns:
        ``[R, T]`` float32 log-probs (gradient flows to the model's parameters).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    num_completion = completion_ids.shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=num_completion + 1,
    ).logits[:, :-1]
    return selected_log_probs(logits, completion_ids, temperature)


def policy_gradient_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "grpo",
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """REINFORCE-with-baseline loss of one on-policy update (GRPO's loss at ratio 1).

    Args:
        log_probs: ``[R, T]`` log-probs of the sampled tokens (with grad).
        advantages: ``[R]`` one advantage per completion (no grad).
        mask: ``[R, T]`` bool, tokens that are scored (see :func:`completion_mask`).
        loss_type: ``"grpo"``: mean over each completion's scored tokens, then mean over rows;
            ``"token_mean"``: sum over all scored tokens / their count (DAPO);
            ``"dr_grpo"``: sum over all scored tokens / (R * max_new_tokens) (Dr. GRPO).
    Returns:
        Scalar loss; its gradient is ``-E[A * grad log pi]`` under the chosen normalisation.
    """
    per_token = -advantages.to(log_probs.dtype).unsqueeze(1) * log_probs
    return aggregate_tokens(per_token, mask, loss_type, max_new_tokens)


def aggregate_tokens(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str = "grpo",
                     max_new_tokens: int | None = None) -> torch.Tensor:
    """Reduce ``[R, T]`` per-token values over the scored tokens ``mask`` to a scalar.

    ``"grpo"``: mean over each row's scored tokens, then over rows; ``"token_mean"``: sum / number
    of scored tokens; ``"dr_grpo"``: sum / (R * max_new_tokens). Unscored positions never count
    (they are selected away, so a NaN or inf there cannot leak into the result).
    """
    mask = mask.bool()
    m = mask.to(per_token.dtype)
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / m.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "token_mean":
        return per_token.sum() / m.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if max_new_tokens is None:
            raise ValueError("loss_type 'dr_grpo' needs max_new_tokens")
        return per_token.sum() / (per_token.shape[0] * max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, loss_type: str = "grpo",
               max_new_tokens: int | None = None) -> torch.Tensor:
    """A KL penalty between the policy and a reference on the sampled tokens, aggregated like the loss.

    Per token the "k3" estimator ``exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020; as in
    GRPO and TRL): on samples of the policy its value estimates KL(policy || reference) without
    bias; never negative, and zero with zero gradient where the policy equals the reference. (As a
    loss on fixed samples its gradient is that of KL(reference || policy), as in GRPO and TRL.)

    Args:
        log_probs: ``[R, T]`` policy log-probs of the sampled tokens (with grad).
        ref_log_probs: ``[R, T]`` the reference policy's log-probs of the same tokens (no grad).
        mask: ``[R, T]`` bool, the tokens the loss scores.
    Returns:
        Scalar, reduced as :func:`aggregate_tokens` with ``loss_type``.
    """
    mask = mask.bool()
    # Unscored positions are zeroed before exp: masking only the result would keep their
    # gradient, and 0 * exp(inf) there would be NaN.
    delta = torch.where(mask, ref_log_probs.to(log_probs.dtype) - log_probs, torch.zeros_like(log_probs))
    return aggregate_tokens(torch.exp(delta) - delta - 1.0, mask, loss_type, max_new_tokens)
