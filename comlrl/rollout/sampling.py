"""Counter-based sampling: what a rollout produces, and how each row draws its tokens.

Row ``r`` draws its random numbers from its own generator, seeded by :func:`derive_seed` from (run
seed, agent, epoch, example, generation[, tree path]). So a completion does not depend on which
other prompts share its batch (batched == one prompt at a time), on the device, or on anything that
happened earlier in the process, and resuming needs no sampler state at all.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SamplingParams", "Rollout", "derive_seed", "row_uniforms", "sample_tokens", "left_pad", "decode_completions"]


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
