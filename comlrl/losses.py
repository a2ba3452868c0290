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
    "linear_selected_log_probs",
]

# Causal LMs whose logits are exactly ``lm_head(final hidden state)`` (no soft-capping or scaling):
# for these the log-probs are computed from the hidden states without materialising all logits.
_PLAIN_HEAD_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "gpt2")
# Keep the logits for the backward pass up to this size; beyond it, recompute them chunk by chunk.
SAVE_LOGITS_BYTES = 256 * 2**20


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


class _LinearSelectedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T (+ bias) / temperature)[token], row by row, with a hand-written
    backward: ``d logits = g * (onehot(token) - softmax)``. Works in place on one logits buffer per
    chunk (exp(logits - max) is kept, or recomputed, for the backward pass), avoiding the several
    full-vocabulary temporaries of autograd through ``logsumexp`` + ``gather`` + slicing."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_rows, save_exp):
        outs, sums, kept = [], [], []
        for start in range(0, hidden.shape[0], chunk_rows):
            end = start + chunk_rows
            shifted, picked, total = _shifted_exp(hidden[start:end], weight, bias, tokens[start:end], temperature)
            outs.append(picked - torch.log(total))  # logit[token] - logsumexp(logits), both shifted by the max
            sums.append(total)
            if save_exp:
                kept.append(shifted)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), tokens, torch.cat(sums),
                              *kept)
        ctx.temperature, ctx.chunk_rows, ctx.has_bias = temperature, chunk_rows, bias is not None
        # The backward recomputes and multiplies under the forward's autocast setting (autocast
        # is off during backward), so recomputed logits match the saved row sums.
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return torch.cat(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled):
            return _LinearSelectedLogProbs._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, bias, tokens, sums, *kept = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_rows)):
            end = start + ctx.chunk_rows
            exp = kept[i] if kept else _shifted_exp(hidden[start:end], weight, bias, tokens[start:end],
                                                    ctx.temperature)[0]
            g = grad_out[start:end].float()
            # d logits = g * onehot(token) - g * softmax, softmax = exp / sum (in place on exp).
            grad_logits = exp.mul_((-g / sums[start:end])[:, None])
            grad_logits.scatter_add_(-1, tokens[start:end, None], g[:, None])
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            # Products in the dtype the forward ran in (autocast's, when it was on; else the common
            # dtype of hidden states and weights, float32 if they differ), gradients in each input's dtype.
            compute = hidden.dtype if hidden.dtype == weight.dtype else torch.float32
            grad_logits = grad_logits.to(compute)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight.to(compute)
            if ctx.needs_input_grad[1]:
                part = (grad_logits.t() @ hidden[start:end].to(compute)).to(weight.dtype)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                part = grad_logits.sum(dim=0).to(bias.dtype)
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _shifted_exp(hidden, weight, bias, tokens, temperature):
    """For a chunk of rows: (exp(logits - max) [n, V] float32, logit[token] - max [n], row sums [n])."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    top = logits.amax(dim=-1, keepdim=True)
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1)
    exp = logits.sub_(top).exp_()
    return exp, picked, exp.sum(dim=-1)


def linear_selected_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              tokens: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024) -> torch.Tensor:
    """``selected_log_probs(hidden @ weight.T + bias, tokens, temperature)`` without keeping
    full-vocabulary autograd temporaries.

    Args:
        hidden: ``[N, H]`` final hidden states; weight ``[V, H]``; bias ``[V]`` or None.
        tokens: ``[N]`` int64 targets.
        chunk_rows: rows per chunk. The logits are kept for the backward pass when all of them fit
            in ``SAVE_LOGITS_BYTES``; otherwise each chunk's are recomputed there, so memory stays
            ``chunk_rows x V`` whatever the number of rows.
    Returns:
        ``[N]`` float32 log-probabilities (differentiable in hidden, weight and bias).
    """
    save = hidden.shape[0] * weight.shape[0] * 4 <= SAVE_LOGITS_BYTES  # float32 exp(logits - max)
    rows = hidden.shape[0] if save else max(1, min(chunk_rows, SAVE_LOGITS_BYTES // (4 * weight.shape[0])))
    return _LinearSelectedLogProbs.apply(hidden, weight, bias, tokens, temperature, max(rows, 1), save)


def _plain_head(model: torch.nn.Module):
    """(backbone, lm_head) when the model's logits are exactly ``lm_head(backbone(...)[0])``."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None  # e.g. a PEFT-wrapped agent: its own forward, whatever it does
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", None)
    if not isinstance(head, torch.nn.Linear) or backbone is None or backbone is model \
            or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return backbone, head


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
    plain = _plain_head(model)
    if plain is not None:
        # Hidden states of the positions that predict the completion tokens, then the head.
        backbone, head = plain
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)[0][:, -num_completion - 1:-1]
        rows, steps = completion_ids.shape
        return linear_selected_log_probs(hidden.reshape(rows * steps, -1), head.weight, head.bias,
                                         completion_ids.reshape(-1), temperature).view(rows, steps)
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
