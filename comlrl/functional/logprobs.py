"""Log-probabilities of sampled tokens under a causal LM, in one padded forward per batch.

Shapes: ``R`` rows (completions), ``P`` prompt length (left-padded), ``T`` completion length
(right-padded), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import torch

__all__ = ["selected_log_probs", "linear_selected_log_probs", "sequence_log_probs", "log_probs_and_hidden",
           "final_hidden_states", "plain_head"]

# Causal LMs whose logits are exactly ``lm_head(final hidden state)`` (no soft-capping or scaling):
# for these the log-probs are computed from the hidden states without materialising all logits.
_PLAIN_HEAD_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "gpt2")
# Keep the logits for the backward pass up to this size; beyond it, recompute them chunk by chunk.
SAVE_LOGITS_BYTES = 256 * 2**20


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
        # Several chunks' parts of the weight's (and bias's) gradient are summed in float32 and cast
        # to the input's dtype once: summed in bfloat16, each chunk's addition would round.
        chunks = -(-hidden.shape[0] // ctx.chunk_rows)
        total = weight.dtype if chunks == 1 else torch.promote_types(weight.dtype, torch.float32)
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
                part = (grad_logits.t() @ hidden[start:end].to(compute)).to(total)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                part = grad_logits.sum(dim=0).to(torch.promote_types(bias.dtype, total))
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


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


def _fsdp_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def plain_head(model: torch.nn.Module):
    """(backbone, lm_head) when the model's logits are exactly ``lm_head(backbone(...)[0])``, else None."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None  # e.g. a PEFT-wrapped agent: its own forward, whatever it does
    if _fsdp_sharded(model):  # the root's own forward gathers the embedding and head: call it whole
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", None)
    if not isinstance(head, torch.nn.Linear) or backbone is None or backbone is model \
            or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return backbone, head


_plain_head = plain_head  # what this module's own forwards call (a test forces the unfused path through it)


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
    return _log_probs(model, prompt_ids, prompt_mask, completion_ids, temperature, with_hidden=False)[0]


def log_probs_and_hidden(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         completion_ids: torch.Tensor, temperature: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_log_probs` and, from the same forward pass, the final hidden states of every
    position (what a value head on this model reads).

    Returns:
        ``([R, T] float32 log-probs, [R, P + T, H] final hidden states)``; position ``P - 1`` is the
        last prompt token of every row (left padding), ``P + n - 1`` the n-th completion token.
    """
    return _log_probs(model, prompt_ids, prompt_mask, completion_ids, temperature, with_hidden=True)


def final_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                        ) -> torch.Tensor:
    """``[R, L, H]`` final hidden states of left-padded sequences (position ids follow the mask),
    without the language-model head where the model allows (a critic needs no logits)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    plain = _plain_head(model)
    if plain is not None:
        return plain[0](input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False)[0]
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def _log_probs(model, prompt_ids, prompt_mask, completion_ids, temperature, with_hidden: bool):
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    num_completion = completion_ids.shape[1]
    plain = _plain_head(model)
    if plain is not None:
        # Hidden states of the positions that predict the completion tokens, then the head.
        backbone, head = plain
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)[0]
        rows, steps = completion_ids.shape
        logp = linear_selected_log_probs(hidden[:, -num_completion - 1:-1].reshape(rows * steps, -1), head.weight,
                                         head.bias, completion_ids.reshape(-1), temperature).view(rows, steps)
        return logp, (hidden if with_hidden else None)
    extra = {"output_hidden_states": True} if with_hidden else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                logits_to_keep=num_completion + 1, **extra)
    logp = selected_log_probs(out.logits[:, :-1], completion_ids, temperature)
    return logp, (out.hidden_states[-1] if with_hidden else None)
