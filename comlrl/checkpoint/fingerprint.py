"""Fingerprints: short digests that tell whether a resumed run is set up like the saved one."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

__all__ = ["digest", "base_fingerprint", "model_fingerprint", "tokenizer_fingerprint", "dataset_fingerprint", "callable_fingerprint",
           "compare_fingerprints"]

# Model config keys that describe where/how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                         "_attn_implementation_autoset", "_attn_implementation", "use_cache"}


def digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps a sharded model's class for a subclass (``FSDPQwen2...``)
    that a resume on another sharding must not see as another architecture."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """Architecture class, config and parameter names/shapes/dtypes (not the values, which train)."""
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    config_dict = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    params = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    return {
        "class": model_class(model).__name__,
        "config": digest(config_dict),
        "parameters": digest(params),
        "trainable": digest([n for n, p in model.named_parameters() if p.requires_grad]),
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Vocabulary, merges, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return digest({
        "class": type(tokenizer).__name__,
        "body": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
    })


def dataset_fingerprint(rows: Iterable[Any]) -> str:
    """Digest of every row's content, in order."""
    h = hashlib.sha256()
    count = 0
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=repr).encode("utf-8"))
        h.update(b"\n")
        count += 1
    return f"{count}:{h.hexdigest()[:16]}"


def _plain_value(value: Any) -> Any:
    """A JSON-ready stand-in for a value a function reads: the value itself when it is immutable
    plain data (numbers, numpy scalars, strings, tuples of them), else its type's name: a module, a model, a
    tokenizer (what it computes is not hashed here), and mutable containers, which a function may
    fill as it runs (a memo cache) and so would make its own run look changed at resume."""
    if isinstance(value, (dict, list, set, bytearray)):
        return f"<{type(value).__qualname__}>"
    if isinstance(value, np.generic):  # an immutable numpy scalar (np.float32(0.5)): its type and value
        item = value.item()
        return {"numpy": type(value).__name__, "value": item if isinstance(item, (bool, int, float, str)) else str(value)}
    if isinstance(value, (tuple, frozenset)):
        items = [_plain_value(v) for v in (sorted(value, key=repr) if isinstance(value, frozenset) else value)]
        return items if isinstance(value, tuple) else {"frozenset": items}
    try:
        json.dumps(value, sort_keys=True, allow_nan=True)
        return value
    except (TypeError, ValueError):
        kind = type(value)
        return f"<{kind.__module__}.{kind.__qualname__}>"


def _global_names(code: Any) -> set[str]:
    """Names ``code`` and the code nested in it (comprehensions, lambdas, inner functions) look
    up; :func:`inspect.getclosurevars` reads only the outer code's."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _outside_values(func: Callable) -> Any:
    """The plain values a function reads from its closure and its module's globals."""
    try:
        found = inspect.getclosurevars(func)
    except (TypeError, ValueError):
        return None
    module_globals = getattr(func, "__globals__", {})
    read = {name: module_globals[name] for name in _global_names(func.__code__) if name in module_globals}

    def plain(values):
        return {k: _plain_value(v) for k, v in sorted(values.items()) if not callable(v) or isinstance(v, type)}
    return {"nonlocals": plain(found.nonlocals), "globals": plain({**found.globals, **read})}


def callable_fingerprint(func: Optional[Callable]) -> Optional[str]:
    """Qualified name plus a digest of the source (or bytecode) of a user function, and of the
    plain values (numbers, strings, lists, dicts) it reads from its closure or module globals.

    Stable across processes: ``functools.partial`` objects are described by their function and
    arguments, callable instances by their class's ``__call__`` and their attributes, never by
    ``repr`` (which holds a memory address). Not covered: what other functions it calls compute,
    and objects that are not plain data (a model, a tokenizer, a file it reads).
    """
    if func is None:
        return None
    if isinstance(func, functools.partial):
        inner = callable_fingerprint(func.func)
        return f"partial({inner}):{digest([list(func.args), func.keywords])}"
    target = getattr(func, "__func__", func)
    if not (inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)) \
            and callable(target) and not isinstance(target, type):
        cls = type(target)
        state = getattr(target, "__dict__", {})
        plain = sorted(((k, _plain_value(v)) for k, v in state.items()), key=lambda kv: kv[0])
        return f"{callable_fingerprint(cls.__call__)}:{digest(plain)}"
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    try:
        body = inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        body = code.co_code.hex() if code is not None else name
    if inspect.isfunction(target):
        body += json.dumps(_outside_values(target), sort_keys=True, default=repr)
    return f"{name}:{hashlib.sha256(body.encode('utf-8')).hexdigest()[:16]}"


def compare_fingerprints(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """Human-readable list of the leaves that differ between two nested fingerprint records."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += compare_fingerprints(saved.get(key), current.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        out = []
        for i, (a, b) in enumerate(zip(saved, current)):
            out += compare_fingerprints(a, b, f"{prefix}[{i}]")
        return out
    if saved != current:
        return [f"{prefix}: saved {saved!r}, now {current!r}"]
    return []


# Values hashed per base tensor by base_fingerprint: the first, the last and an evenly strided sample.
_SAMPLE = 2048


# ------------------------------------------------------------------------------------------------
# fingerprint of the frozen base
# ------------------------------------------------------------------------------------------------

def base_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """A cheap digest of a frozen base model: the same before and after it is wrapped with adapters.

    Args:
        model: a transformers model, a ``peft.PeftModel`` built on one, or an :class:`AdapterAgent`.
            Adapter parameters are left out and peft's ``base_layer`` / ``original_module`` name
            segments dropped, so the plain model and its wrapped form give the same record.
    Returns:
        ``{"class", "config", "parameters", "content", "num_parameters"}``: class name; config digest
        (load-time keys skipped, as :func:`comlrl.fingerprint.model_fingerprint`); digest of parameter
        names / shapes / dtypes; digest of a sample of the values of every base tensor (its first and
        last 2048 values and 2048 evenly strided ones, raw bytes); total number of base values.
        Stable across processes and devices. A base differing only in values outside the sample is not
        detected; any retraining or different checkpoint of the same architecture is.
    """
    base, adapter_names = _unwrap(model)
    config = getattr(base, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    config_dict = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    named = []
    for name, param in base.named_parameters():
        parts = name.split(".")
        if adapter_names.intersection(parts):
            continue
        named.append((".".join(s for s in parts if s not in ("base_layer", "original_module")), param))
    named.sort(key=lambda item: item[0])
    content = hashlib.sha256()
    for name, param in named:
        content.update(name.encode("utf-8"))
        content.update(_sample_bytes(param))
    return {
        "class": type(base).__name__,
        "config": digest(config_dict),
        "parameters": digest([(n, list(p.shape), str(p.dtype)) for n, p in named]),
        "content": content.hexdigest()[:16],
        "num_parameters": sum(p.numel() for _, p in named),
    }


def _unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, set[str]]:
    """(the transformers model, the adapter names to leave out). A comlrl LoRA agent
    (:class:`comlrl.adapters.AdapterAgent`) is known by the PeftModel it runs on, ``shared``."""
    shared = getattr(model, "shared", None)
    if isinstance(shared, torch.nn.Module) and hasattr(shared, "peft_config"):
        model = shared
    peft_config = getattr(model, "peft_config", None)
    names = set(peft_config) if isinstance(peft_config, dict) else set()
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model, names


@torch.no_grad()
def _sample_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n <= 3 * _SAMPLE:
        pieces = [flat]
    else:
        step = n // _SAMPLE
        pieces = [flat[:_SAMPLE], flat[::step][:_SAMPLE], flat[-_SAMPLE:]]
    sample = torch.cat([p.contiguous() for p in pieces]).cpu()
    return bytes(str(tensor.dtype), "ascii") + sample.view(torch.uint8).numpy().tobytes()
