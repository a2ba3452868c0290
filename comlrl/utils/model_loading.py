"""Model-source helpers (CoMLRL's names)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..engine.inputs import infer_model_name, model_kwargs

__all__ = ["infer_model_name", "resolve_model_sources", "resolve_model_kwargs", "freeze_model"]


def resolve_model_kwargs(model_config: Optional[Mapping[str, Any]], overrides: Optional[Mapping[str, Any]] = None
                         ) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments from a ``model_config`` (``overrides`` win)."""
    return {**model_kwargs(model_config), **dict(overrides or {})}


def freeze_model(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients; returns the model."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def resolve_model_sources(*, kind: str, model: Any, models: Optional[Sequence[Any]], expected_count: int,
                          expected_label: Optional[str] = None, model_label: str = "model"
                          ) -> tuple[list[Any], Optional[str]]:
    """One source per model from a shared ``model`` and / or a ``models`` list, and their name."""
    label = expected_label or f"num_{kind}"
    if model is None and models is None:
        raise ValueError(f"Either {model_label} or {kind} must be provided.")
    if models is None:
        return [model] * expected_count, infer_model_name(model)
    models = list(models)
    if len(models) != expected_count:
        raise ValueError(f"{kind} length ({len(models)}) must match {label} ({expected_count}).")
    if any(m is None for m in models):
        raise ValueError(f"{kind} must not contain None.")
    if model is not None and {infer_model_name(m) for m in models} != {infer_model_name(model)}:
        raise ValueError(f"{model_label} and {kind} conflict: every entry must be {infer_model_name(model)!r}.")
    return models, infer_model_name(model if model is not None else models[0])
