"""Tokenizer helpers (CoMLRL's names)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["ensure_pad_token", "ensure_tokenizer", "resolve_tokenizers", "apply_tokenizer_specials"]


def ensure_pad_token(tokenizer: Any) -> Any:
    """Give ``tokenizer`` a pad token (its EOS) when it has none; returns it."""
    if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has neither a pad token nor an eos token to pad with; set "
                         "tokenizer.pad_token.")
    return tokenizer


def ensure_tokenizer(model: Any, tokenizer: Any = None) -> Any:
    """``tokenizer`` (padded), or the one of model name ``model``."""
    if tokenizer is not None:
        return ensure_pad_token(tokenizer)
    if isinstance(model, str):
        from transformers import AutoTokenizer

        from ..engine.hub import load_pretrained

        return ensure_pad_token(load_pretrained(AutoTokenizer, model, "tokenizer"))
    raise ValueError("a tokenizer must be provided when the model is not given by name.")


def resolve_tokenizers(model: Any, tokenizer: Any, agents: Optional[Sequence[Any]] = None) -> Union[Any, list]:
    """One tokenizer (no ``agents``), or one per agent: given, shared, or loaded by name."""
    if agents is None:
        return ensure_tokenizer(model, tokenizer)
    if tokenizer is None:
        if not all(isinstance(a, str) for a in agents):
            raise ValueError("Tokenizer(s) must be provided when agents are model objects.")
        loaded: dict[str, Any] = {}
        for name in agents:
            if name not in loaded:
                loaded[name] = ensure_tokenizer(name)
        return [loaded[name] for name in agents]
    if isinstance(tokenizer, (list, tuple)):
        if len(tokenizer) != len(agents):
            raise ValueError(f"tokenizers length ({len(tokenizer)}) must match agents ({len(agents)}).")
        return [ensure_pad_token(t) for t in tokenizer]
    return ensure_pad_token(tokenizer)


def apply_tokenizer_specials(tokenizer: Any, models: Sequence[Optional[torch.nn.Module]]) -> None:
    """Write the tokenizer's pad and eos ids into each model's config."""
    pad = getattr(tokenizer, "pad_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    for model in models:
        if model is None:
            continue
        config = getattr(getattr(model, "model", None), "config", None) or getattr(model, "config", None)
        if config is not None:
            config.pad_token_id = pad
            config.eos_token_id = eos if eos is not None else pad
