"""The in-process rollout backend: the agents' own ``transformers`` models sample, batched.

One prefill of the left-padded prompts, then one forward of ``[R, 1]`` tokens per new token (on
the lean decoder of :mod:`comlrl.rollout.lean` where the model allows, else transformers' own
forward), logits only for the last position, inverse-CDF sampling with each row's own uniform
numbers (:mod:`comlrl.rollout.sampling`). It stops as soon as every row has produced an EOS.
"""

from __future__ import annotations

import dataclasses

import contextlib
import inspect
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from ..exceptions import DataError
from ..functional.losses import completion_mask
from . import lean as fast_decode
from .sampling import Rollout, SamplingParams, decode_completions, left_pad, row_uniforms, sample_tokens

if TYPE_CHECKING:
    from .compute import ComputeCopy

logger = logging.getLogger("comlrl")

__all__ = ["generate", "rollout", "rollout_agents", "TransformersRollout", "decode_completions"]

# Models the lean decoder declined, so that the reason is logged once per model.
_DECLINED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def explain_decoder(model: torch.nn.Module) -> Optional[str]:
    """Why the lean decoder cannot run ``model`` (None if it can), logged once per model."""
    reason = fast_decode.supports_static_decoding(model)
    if reason is not None and model not in _DECLINED:
        _DECLINED.add(model)
        logger.info("comlrl: the lean decoder does not run %s (%s); it samples with the transformers forward.",
                    type(model).__name__, reason)
    return reason


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
                                          params.max_new_tokens) if backend == "auto" and \
        explain_decoder(model) is None else None
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


_CUT_WARNED: set = set()


def fit_context(models: Sequence[torch.nn.Module], prompt_widths: Sequence[int], params: SamplingParams
                ) -> SamplingParams:
    """``params`` with max_new_tokens lowered so that prompt and completion fit every model's context
    window (said once per window): completions are cut there rather than running past it. A prompt
    that fills the window by itself is a DataError."""
    room = params.max_new_tokens
    for model, width in zip(models, prompt_widths):
        config = getattr(model, "config", None)
        window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(window, int):
            if width >= window:  # no room for one token: the forward would run past the model's positions
                raise DataError(f"a prompt of {width} tokens does not fit the model's context of {window} positions "
                                "(none would be left for the completion); shorten the prompts (or a multi-turn "
                                "history) or leave such rows out of the dataset.")
            room = min(room, window - width)
    if room == params.max_new_tokens:
        return params
    if room not in _CUT_WARNED:
        _CUT_WARNED.add(room)
        logger.warning("comlrl: prompt and max_new_tokens=%d exceed the model's context; completions of these "
                       "prompts stop after %d tokens.", params.max_new_tokens, room)
    return dataclasses.replace(params, max_new_tokens=room)


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
    params = fit_context([model], [prepared.prompt_ids.shape[1]], params)
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
    params = fit_context(models, [p.prompt_ids.shape[1] for p in prepared], params)
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
    """The in-process backend: the agents' own models sample (:func:`rollout_agents`), so they
    always see the live weights. An agent whose ``generate`` was replaced on the model object, or
    every agent with ``backend="generate"``, samples through ``model.generate`` instead
    (:mod:`comlrl.rollout.generate_backend`).

    Args:
        backend: ``"auto"`` (the lean decoder where supported), ``"hf"`` (transformers' forward
            at every step) or ``"generate"``.
    """

    def __init__(self, models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], backend: str = "auto",
                 compute_dtype: Optional[torch.dtype] = None):
        from .compute import ComputeCopy, wants_compute_copy
        from .generate_backend import has_custom_generate

        self.models, self.tokenizers = list(models), list(tokenizers)
        self.decoder = "auto" if backend == "generate" else backend
        self.via_generate = [backend == "generate" or (backend == "auto" and has_custom_generate(m))
                             for m in self.models]
        # compute_dtype (mixed precision): agents sampling through our loop sample with a copy of
        # their weights in that dtype, refreshed when marked stale (rollout/compute.py).
        self.copies: list[Optional[ComputeCopy]] = [
            ComputeCopy(m, compute_dtype) if not g and wants_compute_copy(m, compute_dtype) is None else None
            for m, g in zip(self.models, self.via_generate)]
        self.stale: set[int] = set()

    def sampling_models(self) -> list[torch.nn.Module]:
        """What each agent samples with: its compute copy (refreshed if stale), else the model itself."""
        for a in sorted(self.stale):
            self._refresh(a)
        return [c.module if c is not None else m for c, m in zip(self.copies, self.models)]

    def compute_copy(self, agent: int) -> Optional[ComputeCopy]:
        """Agent ``agent``'s compute copy, current (refreshed if stale), or None without one."""
        if agent in self.stale:
            self._refresh(agent)
        return self.copies[agent]

    def _refresh(self, agent: int) -> None:
        copy = self.copies[agent]
        if copy is not None:
            copy.refresh()
        self.stale.discard(agent)

    def sample(self, prompts: Sequence[Sequence[str]], seeds: Sequence[Sequence[Sequence[int]]],
               params: SamplingParams, eos_token_ids: Sequence[Sequence[int]],
               add_special_tokens: Sequence[bool]) -> list[Rollout]:
        from .generate_backend import generate_rollout

        loop = [a for a, g in enumerate(self.via_generate) if not g]
        out: list[Optional[Rollout]] = [None] * len(self.models)
        if loop:
            models = self.sampling_models()
            pick = lambda values: [values[a] for a in loop]  # noqa: E731
            # Copies compute in their own dtype: autocast (the trainer's, around sampling) would only
            # add its per-op dispatch. Agents without a copy keep the caller's autocast.
            plain = all(self.copies[a] is not None for a in loop)
            with _autocast_off(pick(models)) if plain else contextlib.nullcontext():
                for a, ro in zip(loop, rollout_agents(pick(models), pick(self.tokenizers), pick(prompts),
                                                      pick(seeds), params, pick(eos_token_ids),
                                                      pick(add_special_tokens), backend=self.decoder)):
                    out[a] = ro
        for a, use in enumerate(self.via_generate):
            if use:
                out[a] = generate_rollout(self.models[a], self.tokenizers[a], prompts[a], seeds[a], params,
                                          eos_token_ids[a], add_special_tokens[a])
        return out  # type: ignore[return-value]

    def mark_stale(self, agents: Optional[Sequence[int]] = None) -> None:
        """The agents' weights changed: their compute copies are refreshed before they next sample
        (without copies sampling reads the models' parameters themselves)."""
        self.stale.update(range(len(self.models)) if agents is None else agents)

    def close(self) -> None:
        """Nothing to release."""


def _autocast_off(models: Sequence[torch.nn.Module]) -> contextlib.AbstractContextManager:
    """Autocast disabled on every device type ``models`` are on."""
    stack = contextlib.ExitStack()
    for device_type in sorted({next(m.parameters()).device.type for m in models}):
        stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
    return stack


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

