"""Rollout: every agent samples K completions per prompt, batched over prompts x generations.

Sampling is counter-based: row ``r`` draws its random numbers from its own generator, seeded by
:func:`derive_seed` from (run seed, agent, epoch, example, generation). So a completion does not
depend on which other prompts share its batch (batched == one prompt at a time), on the device,
or on anything that happened earlier in the process, and resuming needs no sampler state at all.

The sampler is a plain KV-cache loop: one prefill of the left-padded prompts, then one forward of
``[R, 1]`` tokens per new token, logits only for the last position, inverse-CDF sampling with the
row's uniform number. It stops as soon as every row has produced an end-of-sequence token.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from . import fast_decode
from .losses import completion_mask

logger = logging.getLogger("comlrl")

__all__ = [
    "Rollout",
    "SamplingParams",
    "derive_seed",
    "row_uniforms",
    "sample_tokens",
    "generate",
    "rollout",
    "rollout_agents",
    "TransformersRollout",
]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``top_k`` None or 0 = no limit; ``top_p`` 1.0 = no nucleus cut."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None


@dataclass
class Rollout:
    """One agent's completions for a batch of prompts. Rows are prompt-major: row = g * K + k."""

    prompt_ids: torch.Tensor       # [R, P] int64, left-padded with pad_token_id
    prompt_mask: torch.Tensor      # [R, P] int64, 1 = real prompt token
    completion_ids: torch.Tensor   # [R, T] int64, right-padded after the first EOS
    completion_mask: torch.Tensor  # [R, T] bool, tokens up to and including the first EOS
    group_ids: torch.Tensor        # [R] int64, index of the prompt (group) of each row
    texts: list[str]               # R decoded completions, EOS and padding stripped

    @property
    def lengths(self) -> torch.Tensor:
        """``[R]`` number of scored tokens per completion."""
        return self.completion_mask.sum(dim=1)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and platforms)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def row_uniforms(seeds: Sequence[int], length: int) -> torch.Tensor:
    """``[R, length]`` float64 uniforms in (0, 1], row r drawn from its own generator ``seeds[r]``."""
    rows = [torch.rand(length, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    return 1.0 - torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.float64)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: Optional[int] = None) -> torch.Tensor:
    """Draw one token per row by inverting the CDF of the filtered distribution.

    Args:
        logits: ``[R, V]`` next-token logits.
        uniforms: ``[R]`` numbers in (0, 1]; the same number always picks the same token from the
            same distribution, which is what makes sampling reproducible row by row.
    Returns:
        ``[R]`` int64 token ids. Filtering follows transformers' order: temperature, top-k, top-p.
        The CDF runs over token ids in increasing order whichever path computes it.
    """
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    vocab = scores.shape[-1]
    if top_k and top_k < vocab:
        k = int(top_k)
        # k + 1 candidates, sorted descending: the extra one tells whether the k-th score is tied.
        top_scores, top_ids = torch.topk(scores, k + 1, dim=-1)
        # Fast path, row by row: work on the k candidates only (O(k) instead of O(V) per step).
        # Valid unless a tie at the k-th score keeps more than k tokens, as transformers' top-k
        # does; such rows take the full path. Each row's path depends on that row alone, so a
        # row's token never depends on which other rows (or agents) share the batch.
        untied = top_scores[:, k] < top_scores[:, k - 1]
        if bool(untied.all()):
            return _sample_candidates(top_scores[:, :k], top_ids[:, :k], uniforms, top_p)
        tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        if bool(untied.any()):
            tokens[untied] = _sample_candidates(top_scores[untied, :k], top_ids[untied, :k], uniforms[untied], top_p)
        tied = ~untied
        kth = top_scores[tied, k - 1:k]
        rest = scores[tied]
        tokens[tied] = _sample_full(rest.masked_fill(rest < kth, -torch.inf), uniforms[tied], top_p)
        return tokens
    return _sample_full(scores, uniforms, top_p)


def _sample_full(scores: torch.Tensor, uniforms: torch.Tensor, top_p: float) -> torch.Tensor:
    """Inverse-CDF sampling over the whole vocabulary (token-id order) after the nucleus cut."""
    vocab = scores.shape[-1]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
    if top_p < 1.0:
        probs = probs.masked_fill(_nucleus_drop(probs, top_p), 0.0)
    return _invert_cdf(probs, uniforms, torch.arange(vocab, device=probs.device).expand_as(probs))


def _nucleus_drop_sorted(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities sorted descending: which fall outside the smallest set holding ``top_p``."""
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    drop[:, 0] = False  # always keep the most likely token
    return drop


def _nucleus_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[R, V]`` bool: tokens outside the smallest most-likely set holding ``top_p`` of the mass."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, _nucleus_drop_sorted(sorted_probs, top_p))


def _sample_candidates(top_scores: torch.Tensor, top_ids: torch.Tensor, uniforms: torch.Tensor,
                       top_p: float) -> torch.Tensor:
    probs = torch.softmax(top_scores, dim=-1, dtype=torch.float64)  # [R, k], descending
    if top_p < 1.0:
        probs = probs.masked_fill(_nucleus_drop_sorted(probs, top_p), 0.0)
    ids, order = torch.sort(top_ids, dim=-1)  # token-id order, like the full-vocabulary CDF
    return _invert_cdf(probs.gather(-1, order), uniforms, ids)


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token ``ids[r, j]`` for the first j whose cumulative probability reaches ``u * total``."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target).clamp_(max=probs.shape[-1] - 1)
    return ids.gather(-1, pos).squeeze(-1)


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 names the KV cache argument ``cache``; older releases ``past_key_values``."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _output_cache(output: object) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values")


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             uniforms: torch.Tensor, params: SamplingParams, eos_token_ids: Sequence[int],
             pad_token_id: int, backend: str = "auto") -> torch.Tensor:
    """Sample completions for left-padded prompts with a KV cache.

    Args:
        prompt_ids, prompt_mask: ``[R, P]`` on the model's device, left-padded.
        uniforms: ``[R, max_new_tokens]`` from :func:`row_uniforms`.
        backend: ``"hf"``: every step is a transformers forward with its dynamic cache;
            ``"auto"``: after the transformers prefill, one-token steps run on
            :class:`comlrl.fast_decode.StaticDecoder` when the model is supported (checked against
            the transformers step once per model), else as ``"hf"``.
    Returns:
        ``[R, T]`` int64 completion ids, ``T <= max_new_tokens`` (the loop stops once every row
        has ended); positions after a row's first EOS hold ``pad_token_id``.
    """
    device = prompt_ids.device
    rows = prompt_ids.shape[0]
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    cache_kw = _cache_kwarg(model)
    attention = prompt_mask
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions,
                use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1, :]
    next_position = positions[:, -1:] + 1
    fast = fast_decode.static_decoder_for(model, _output_cache(out), prompt_mask, next_position[:, 0],
                                          params.max_new_tokens) if backend == "auto" else None
    if fast is not None and not fast_decode.needs_check(model):
        out = None  # the static cache holds the prompt now: free transformers' copy
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    uniforms = uniforms.to(device)
    ones = torch.ones(rows, 1, dtype=attention.dtype, device=device)
    steps = []
    for t in range(params.max_new_tokens):
        token = sample_tokens(logits, uniforms[:, t], params.temperature, params.top_p, params.top_k)
        token = token.masked_fill(finished, pad_token_id)
        steps.append(token)
        finished |= torch.isin(token, eos)
        if t + 1 == params.max_new_tokens or bool(finished.all()):
            break
        if fast is not None:  # the static cache needs no attention mask: only the transformers steps do
            fast_logits = fast.step(token)
            if fast_decode.needs_check(model):  # once per model: the same step through transformers
                attention = torch.cat([attention, ones], dim=1)
                out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=next_position,
                            use_cache=True, **{cache_kw: _output_cache(out)})
                if not fast_decode.record_check(model, fast_logits, out.logits[:, -1, :]):
                    fast, fast_logits = None, out.logits[:, -1, :]
            logits = fast_logits
        else:
            attention = torch.cat([attention, ones], dim=1)
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=next_position,
                        use_cache=True, **{cache_kw: _output_cache(out)})
            logits = out.logits[:, -1, :]
        next_position = next_position + 1
    return torch.stack(steps, dim=1)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``[R, P]`` ids and an attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


@dataclass
class _Prepared:
    """One agent's encoded rows, before sampling."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    uniforms: torch.Tensor
    group_ids: torch.Tensor


def _prepare(model: torch.nn.Module, tokenizer, prompts: Sequence[str], seeds: Sequence[Sequence[int]],
             params: SamplingParams, add_special_tokens: bool) -> _Prepared:
    device = next(model.parameters()).device
    # Prompts rendered by a chat template already carry their special tokens (BOS, role markers).
    encoded = tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]
    group_size = len(seeds[0])
    rows = [ids for ids in encoded for _ in range(group_size)]
    prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id, device)
    uniforms = row_uniforms([s for group in seeds for s in group], params.max_new_tokens)
    group_ids = torch.arange(len(prompts), device=device).repeat_interleave(group_size)
    return _Prepared(prompt_ids, prompt_mask, uniforms, group_ids)


def _finish(prepared: _Prepared, completion_ids: torch.Tensor, tokenizer, eos_token_ids: Sequence[int]) -> Rollout:
    # clone(): tensors made under inference_mode cannot enter the autograd graph of the update.
    completion_ids = completion_ids.clone()
    mask = completion_mask(completion_ids, eos_token_ids)
    texts = decode_completions(tokenizer, completion_ids, mask, eos_token_ids)
    return Rollout(prepared.prompt_ids, prepared.prompt_mask, completion_ids, mask, prepared.group_ids, texts)


def rollout(model: torch.nn.Module, tokenizer, prompts: Sequence[str], seeds: Sequence[Sequence[int]],
            params: SamplingParams, eos_token_ids: Sequence[int], add_special_tokens: bool = True,
            backend: str = "auto") -> Rollout:
    """Sample ``K = len(seeds[g])`` completions for each prompt ``g`` in one batched call.

    Args:
        prompts: G prompt strings.
        seeds: ``[G][K]`` per-completion seeds (see :func:`derive_seed`).
        add_special_tokens: False for prompts rendered by a chat template.
        backend: ``"auto"`` or ``"hf"`` (see :func:`generate`).
    Returns:
        A :class:`Rollout` with ``R = G * K`` rows, prompt-major.
    """
    prepared = _prepare(model, tokenizer, prompts, seeds, params, add_special_tokens)
    with _eval_mode([model]):
        completion_ids = generate(model, prepared.prompt_ids, prepared.prompt_mask, prepared.uniforms, params,
                                  eos_token_ids, tokenizer.pad_token_id, backend)
    return _finish(prepared, completion_ids, tokenizer, eos_token_ids)


def rollout_agents(models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], prompts: Sequence[Sequence[str]],
                   seeds: Sequence[Sequence[Sequence[int]]], params: SamplingParams,
                   eos_token_ids: Sequence[Sequence[int]], add_special_tokens: Sequence[bool],
                   backend: str = "auto", concurrent: Optional[bool] = None) -> list[Rollout]:
    """Every agent's :func:`rollout` for one turn (agents sample independently of each other).

    With ``backend="auto"`` and agents of one supported layout (see
    :func:`comlrl.fast_decode.stackable`: e.g. copies of one model), the agents take their one-token
    steps together, weights stacked, in one :class:`comlrl.fast_decode.StackedDecoder`. Otherwise
    each agent samples on its own, and agents on separate CUDA devices do so at the same time, one
    thread per agent (``concurrent``; None = exactly then): CUDA kernels run asynchronously, so
    the devices work in parallel. Either way agent ``a``'s rows use its own seeds ``seeds[a]`` and
    the results are the same.
    """
    # Tokenizers are not thread-safe: encode here, whatever samples afterwards.
    prepared = [_prepare(m, t, p, s, params, add)
                for m, t, p, s, add in zip(models, tokenizers, prompts, seeds, add_special_tokens)]
    pads = [t.pad_token_id for t in tokenizers]
    completions = None
    with _eval_mode(models):
        if backend == "auto" and len(models) > 1 and fast_decode.stackable(list(models)) \
                and len({p.prompt_ids.shape[0] for p in prepared}) == 1:
            try:
                completions = generate_stacked(list(models), prepared, params, eos_token_ids, pads)
            except _FallBack:  # a model failed its one-time check: each agent on its own from now on
                pass
            except (RuntimeError, ValueError) as exc:
                logger.warning("comlrl: stacked decoding failed (%s); sampling agent by agent.", exc)
        if completions is None:
            devices = [next(m.parameters()).device for m in models]
            if concurrent is None:
                concurrent = len(set(devices)) == len(models) > 1 and all(d.type == "cuda" for d in devices)
            if concurrent:
                # Autocast is per thread: hand the caller's setting to the workers.
                autocast = {d.type: torch.get_autocast_dtype(d.type) for d in devices
                            if torch.is_autocast_enabled(d.type)}
                with ThreadPoolExecutor(max_workers=len(models), thread_name_prefix="comlrl-rollout") as pool:
                    futures = [pool.submit(_generate_on, d, m, p, params, e, pad, backend, autocast)
                               for d, m, p, e, pad in zip(devices, models, prepared, eos_token_ids, pads)]
                    completions = [f.result() for f in futures]
            else:
                completions = [generate(m, p.prompt_ids, p.prompt_mask, p.uniforms, params, e, pad, backend)
                               for m, p, e, pad in zip(models, prepared, eos_token_ids, pads)]
    return [_finish(p, c, t, e) for p, c, t, e in zip(prepared, completions, tokenizers, eos_token_ids)]


class TransformersRollout:
    """The default rollout backend: the agents' own ``transformers`` models sample in this process
    (:func:`rollout_agents`), so they always see the live weights.

    Every backend has this interface (see also :class:`comlrl.vllm_backend.VLLMRollout`):
    ``sample(prompts, seeds, params, eos_token_ids, add_special_tokens) -> list[Rollout]`` for one
    turn of every agent; ``mark_stale(agents=None)`` after the agents' weights change; ``close()``.

    Args:
        decoder: ``"auto"`` (the lean decoder where supported) or ``"hf"`` (see :func:`generate`).
    """

    def __init__(self, models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], decoder: str = "auto"):
        self.models, self.tokenizers, self.decoder = list(models), list(tokenizers), decoder

    def sample(self, prompts: Sequence[Sequence[str]], seeds: Sequence[Sequence[Sequence[int]]],
               params: SamplingParams, eos_token_ids: Sequence[Sequence[int]],
               add_special_tokens: Sequence[bool]) -> list[Rollout]:
        return rollout_agents(self.models, self.tokenizers, prompts, seeds, params, eos_token_ids,
                              add_special_tokens, backend=self.decoder)

    def mark_stale(self, agents: Optional[Sequence[int]] = None) -> None:
        """Nothing to do: sampling reads the models' parameters themselves."""

    def close(self) -> None:
        pass


def _generate_on(device: torch.device, model: torch.nn.Module, prepared: _Prepared, params: SamplingParams,
                 eos_token_ids: Sequence[int], pad_token_id: int, backend: str,
                 autocast: dict[str, torch.dtype]) -> torch.Tensor:
    """:func:`generate` in a worker thread, with the agent's CUDA device current in that thread and
    the calling thread's autocast settings (``{device_type: dtype}``)."""
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        for device_type, dtype in autocast.items():
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
        return generate(model, prepared.prompt_ids, prepared.prompt_mask, prepared.uniforms, params, eos_token_ids,
                        pad_token_id, backend)


class _FallBack(Exception):
    """A stacked rollout found a model whose fast step disagrees with transformers."""


class _eval_mode:
    """Run models in eval mode (no dropout) and restore each one's mode afterwards."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        self.models, self.modes = list(models), [m.training for m in models]

    def __enter__(self):
        for m in self.models:
            m.eval()

    def __exit__(self, *exc):
        for m, mode in zip(self.models, self.modes):
            m.train(mode)


@torch.inference_mode()
def generate_stacked(models: list[torch.nn.Module], prepared: list[_Prepared], params: SamplingParams,
                     eos_token_ids: Sequence[Sequence[int]], pad_token_ids: Sequence[int]) -> list[torch.Tensor]:
    """:func:`generate` for N models at once: each prefills its own prompts, then all take their
    one-token steps in one :class:`comlrl.fast_decode.StackedDecoder` and draw their tokens in one
    :func:`sample_tokens` call (every row still with its own uniforms). Agent ``a``'s result has
    exactly the length :func:`generate` would give it (its rows' own stopping point).
    """
    n, rows = len(models), prepared[0].prompt_ids.shape[0]
    device = prepared[0].prompt_ids.device
    outs, first_positions = [], []
    for model, p in zip(models, prepared):
        positions = (p.prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        outs.append(model(input_ids=p.prompt_ids, attention_mask=p.prompt_mask, position_ids=positions,
                          use_cache=True, logits_to_keep=1))
        first_positions.append(positions[:, -1] + 1)
    decoder = fast_decode.StackedDecoder(models, [_output_cache(o) for o in outs],
                                         [p.prompt_mask for p in prepared], first_positions, params.max_new_tokens)
    check = [fast_decode.needs_check(m) for m in models]
    if any(check):  # keep each model's transformers state for its one-time check
        caches = [_output_cache(o) for o in outs]
        attentions = [p.prompt_mask for p in prepared]
    logits = torch.stack([o.logits[:, -1, :] for o in outs])  # [N, R, V]
    del outs  # the stacked cache holds the prompts now
    vocab = logits.shape[-1]
    uniforms = torch.cat([p.uniforms for p in prepared]).to(device)
    pads = torch.tensor(pad_token_ids, device=device).repeat_interleave(rows)
    # Each row's end-of-sequence ids, padded with -1 (no token): [N * R, E].
    width = max(len(set(e)) for e in eos_token_ids)
    eos = torch.tensor([sorted(set(e)) + [-1] * (width - len(set(e))) for e in eos_token_ids],
                       device=device).repeat_interleave(rows, dim=0)
    finished = torch.zeros(n * rows, dtype=torch.bool, device=device)
    lengths: list[Optional[int]] = [None] * n
    steps = []
    for t in range(params.max_new_tokens):
        token = sample_tokens(logits.reshape(n * rows, vocab), uniforms[:, t], params.temperature, params.top_p,
                              params.top_k)
        token = torch.where(finished, pads, token)
        steps.append(token)
        finished |= (token[:, None] == eos).any(dim=1)
        done = finished.view(n, rows).all(dim=1).tolist()
        for a in range(n):
            if lengths[a] is None and done[a]:
                lengths[a] = t + 1
        if t + 1 == params.max_new_tokens or all(done):
            break
        logits = decoder.step(token.view(n, rows))
        if t == 0 and any(check):
            for a, model in enumerate(models):
                attentions[a] = torch.cat([attentions[a], torch.ones_like(attentions[a][:, :1])], dim=1)
                if not check[a]:
                    continue
                ref = model(input_ids=token[a * rows:(a + 1) * rows, None], attention_mask=attentions[a],
                            position_ids=first_positions[a][:, None], use_cache=True,
                            **{_cache_kwarg(model): caches[a]})
                if not fast_decode.record_check(model, logits[a], ref.logits[:, -1, :]):
                    raise _FallBack()
    completions = torch.stack(steps, dim=1).view(n, rows, -1)
    return [completions[a, :, :lengths[a] or completions.shape[-1]] for a in range(n)]


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor,
                       eos_token_ids: Sequence[int]) -> list[str]:
    """Decode each row's scored tokens, dropping the closing EOS."""
    eos = set(eos_token_ids)
    ids = completion_ids.tolist()
    lengths = mask.sum(dim=1).tolist()
    kept = []
    for row, n in zip(ids, lengths):
        row = row[:n]
        if row and row[-1] in eos:
            row = row[:-1]
        kept.append(row)
    return tokenizer.batch_decode(kept, skip_special_tokens=True)
