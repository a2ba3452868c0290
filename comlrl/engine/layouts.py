"""How each trained module's checkpoint folder is laid out, so that the tools people already use
load it as it is: ``AutoModelForCausalLM.from_pretrained(checkpoint / "agent-0")``, PEFT, vLLM,
``CausalLMWithValueHead.from_pretrained`` for value models.

A module is one of:

* a transformers model: ``model.safetensors`` (its own key names, tied weights once under the name
  ``save_pretrained`` keeps), ``config.json``, ``generation_config.json``;
* a comlrl LoRA agent (:class:`comlrl.adapters.AdapterAgent`): PEFT's ``adapter_model.safetensors``
  and ``adapter_config.json`` naming the base model;
* a wrapper that names its parts (``checkpoint_parts()``, e.g. :class:`CausalLMWithValueHead`:
  ``{"model": backbone, "value_head": head}``): its first part laid out as above, every other part
  as ``<name>.safetensors``, plus the wrapper's ``checkpoint_sidecars()`` (``value_head.json``);
* anything else: its whole state dict in ``model.safetensors``.

Agent folders also get their tokenizer's files. The side files are built once per trainer (a
large tokenizer is not re-serialised at every save) and hold no weights: nothing is stored twice.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint.files import PLAIN_LAYOUT, SlotLayout
from ..checkpoint.fingerprint import model_class

__all__ = ["module_layout", "ADAPTER_FILE", "MODEL_FILE"]

MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
# Bounds what a tokenizer's save_pretrained may add to every checkpoint (a real one is a few MB).
_MAX_SIDECAR_BYTES = 64 * 2**20


def module_layout(module: torch.nn.Module, tokenizer: Any = None) -> SlotLayout:
    """The folder layout of ``module`` (see the module docstring), with ``tokenizer``'s files
    when given."""
    parts_of = getattr(module, "checkpoint_parts", None)
    if callable(parts_of):
        parts = list(parts_of().items())
        (first, backbone), rest = parts[0], parts[1:]
        inner = _backbone_layout(backbone)
        layout_parts = tuple((f"{first}.{prefix}", file) for prefix, file in inner.parts)
        layout_parts += tuple((f"{name}.", f"{name}.safetensors") for name, _ in rest)
        sidecars = {**inner.sidecars, **getattr(module, "checkpoint_sidecars", dict)()}
    else:
        inner = _backbone_layout(module)
        layout_parts, sidecars = inner.parts, dict(inner.sidecars)
    if tokenizer is not None:
        sidecars.update(tokenizer_files(tokenizer))
    return SlotLayout(layout_parts, sidecars)


def _backbone_layout(model: torch.nn.Module) -> SlotLayout:
    from ..adapters import AdapterAgent

    if isinstance(model, AdapterAgent):
        return SlotLayout((("", ADAPTER_FILE),), {"adapter_config.json": _adapter_config(model)})
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not hasattr(model, "save_pretrained"):
        return PLAIN_LAYOUT
    sidecars = {"config.json": _model_config(model)}
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        sidecars["generation_config.json"] = generation.to_json_string().encode("utf-8")
    return SlotLayout((("", MODEL_FILE),), sidecars)


def _model_config(model: torch.nn.Module) -> bytes:
    """``config.json`` as ``save_pretrained`` writes it: the architecture and the weights' dtype
    filled in (vLLM picks the model class from ``architectures``)."""
    config = copy.deepcopy(model.config)
    config.architectures = [model_class(model).__name__]
    first = next(iter(model.parameters()), None)
    if first is not None and first.is_floating_point():
        config.dtype = str(first.dtype).split(".")[-1]
    return config.to_json_string().encode("utf-8")


def _adapter_config(agent: Any) -> bytes:
    """PEFT's ``adapter_config.json`` of a LoRA agent (``base_model_name_or_path`` names its base),
    written by PEFT's own serialiser."""
    config = copy.deepcopy(agent.adapter_config)
    config.inference_mode = True
    if not config.base_model_name_or_path:  # peft leaves it empty for transformers 5 models
        base = agent.get_base_model()
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or base.config._name_or_path or None
    with tempfile.TemporaryDirectory(prefix="comlrl-adapter-") as tmp:
        config.save_pretrained(tmp)
        return (Path(tmp) / "adapter_config.json").read_bytes()


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """``{name: bytes}`` of what ``tokenizer.save_pretrained`` writes (nothing for a tokenizer
    that cannot save itself)."""
    if not hasattr(tokenizer, "save_pretrained"):
        return {}
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="comlrl-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        for file in sorted(Path(tmp).rglob("*")):
            if file.is_file():
                out[file.relative_to(tmp).as_posix()] = file.read_bytes()
    if sum(len(b) for b in out.values()) > _MAX_SIDECAR_BYTES:
        return {}  # an unusual tokenizer: keep checkpoints lean (export writes it with save_model)
    return out


def slot_index(slot: str) -> Optional[int]:
    """i of a slot named ``kind-i``."""
    tail = slot.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None
