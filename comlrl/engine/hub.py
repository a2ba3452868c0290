"""Loading models and tokenizers by name, with one clear error when that fails.

``from_pretrained`` of a hub name that is not cached, with the hub offline or unreachable, ends in
a long traceback whose last line does not say what to do here; :func:`load_pretrained` turns it
into a :class:`~comlrl.exceptions.ModelLoadError` of one line that does."""

from __future__ import annotations

import os
from typing import Any

from ..exceptions import ModelLoadError

__all__ = ["load_pretrained", "hub_offline", "load_failure_text", "OFFLINE_ADVICE"]

OFFLINE_ADVICE = ("pass a local model directory instead (comlrl.testing.tiny_model_dir() builds a tiny random Qwen2 "
                  "and its tokenizer offline; `tiny` in a comlrl YAML config), or download the model once where the "
                  "hub can be reached (huggingface-cli download NAME) and run with HF_HUB_OFFLINE=1")


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off for this process (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def load_failure_text(what: str, source: str, exc: BaseException) -> str:
    """One line on why ``source`` did not load and what to do."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = (lines[0][:200].rstrip(".") if lines else "") or type(exc).__name__
    if os.path.isdir(os.path.expanduser(source)):
        return f"cannot load {what} from the directory {source!r}: {first}."
    reached = not (hub_offline() or "connect" in str(exc) or "offline" in str(exc).lower())
    if reached:
        return (f"cannot load {what} {source!r}: it is not a local directory, and the hub says: {first}. Check the "
                f"name, or {OFFLINE_ADVICE}.")
    why = "the hub is offline (HF_HUB_OFFLINE=1)" if hub_offline() else "the hub cannot be reached"
    return (f"cannot load {what} {source!r}: it is not a local directory, {why}, and it is not in the local cache; "
            f"{OFFLINE_ADVICE}.")


def load_pretrained(loader: Any, source: str, what: str = "model", **kwargs: Any) -> Any:
    """``loader.from_pretrained(source, **kwargs)``; an ``OSError`` (not found, not cached, hub
    unreachable) becomes a one-line :class:`ModelLoadError` naming ``what`` and ``source``."""
    try:
        return loader.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise ModelLoadError(load_failure_text(what, str(source), exc)) from None
