"""A run described in YAML: its layout, its flags, checking it, and building the trainer from it.

The layout mirrors the Python API, so every name is the one the docs already use::

    trainer:                    # the trainer's constructor arguments
      name: MAGRPO              # any registered trainer (comlrl trainers)
      args: {...}               # its config (MAGRPOConfig, IACConfig, ...): every field
      agent_model: tiny         # models, tokenizer, datasets, functions, wandb_config, ...
    train:                      # trainer.train(...) arguments, and what to do after it
      checkpoint_dir: runs/x

Nothing here lists a trainer's fields by hand: the keys of ``trainer`` are the trainer's
``__init__`` parameters, those of ``trainer.args`` its config's dataclass fields (with their docs
and checks), those of ``train`` the parameters of ``train()``. Every key is also a flag: a config
field as ``--field`` and ``--trainer.args.field``, a train() argument as ``--name`` and
``--train.name``, any other key by its dotted path (``--trainer.train_dataset.split test``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..exceptions import ComlrlError, ConfigError
from .refs import RefError, find_path, is_ref, resolve_ref
from .registry import TrainerEntry, init_parameters, lookup_trainer, train_parameters
from .yamlconf import CliError, Document, Key, load_document, parse_value

__all__ = ["RunSpec", "Option", "options_for", "parse_run_args", "check_run", "build_trainer", "locate_error",
           "TRAIN_EXTRAS"]

SECTIONS = ("trainer", "train")
TRAIN_EXTRAS = {
    "save_model": "After training, write the agents to this directory (trainer.save_model).",
    "merge_adapters": "With save_model: merge LoRA adapters into plain models (default: adapter folders).",
}
TRAIN_DOCS = {
    "resume_from_checkpoint": "'auto' (the newest checkpoint of checkpoint_dir that verifies; a new run if none) "
                              "or a checkpoint-N directory: continue that run.",
    "checkpoint_dir": "Where checkpoint-N directories and metrics.jsonl go (the run locks it).",
    "checkpoint_interval": "Save a checkpoint every this many epochs (and after the last).",
    "checkpoint_total_limit": "Keep only the newest this many checkpoints of the run.",
    "save_steps": "Also save after every this many optimizer steps.",
}
_CALLABLES = {"reward_func", "reward_processor", "formatters", "external_transition", "eval_logger",
              "eval_aggregator", "metrics_callback"}
_KIND_HELP = {
    "dataset": "a file, hub name, list of prompts or {path, split, prompt_column, ...}",
    "tokenizer": "a model name or directory, or one per agent",
    "model": "a model name or directory, 'tiny', or a list of them",
    "callable": "'module:function' or 'path/file.py:function'",
    "peft": "LoRA settings: a peft.LoraConfig mapping",
    "plain": "a mapping",
    "object": "a value, or {call: 'module:factory', ...}",
}
_DATASET_KEYS = {
    "path": "a local file (.json, .jsonl, .csv, .parquet, .txt), a save_to_disk directory or a hub dataset name",
    "name": "the hub dataset's configuration name",
    "split": "the split to use (default 'train'; slices such as 'train[:100]' work)",
    "prompt_column": "the column that holds the prompts (renamed to 'prompt')",
    "columns": "other renames, {old: new}",
    "limit": "use only the first N rows",
    "prompts": "a list of prompt strings instead of a file",
    "rows": "a list of row mappings instead of a file",
}


# --- flags ----------------------------------------------------------------------------------------

@dataclass
class Option:
    """One command-line flag (with its aliases) for one key of the config."""

    key: Key
    flags: list[str]
    help: str
    as_string: bool = False
    boolean: bool = False


def _type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _docs(config: type) -> dict[str, str]:
    if hasattr(config, "field_docs"):
        return dict(config.field_docs())
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(config)}


def options_for(entry: TrainerEntry, extra: Sequence[Option] = ()) -> list[Option]:
    """Every flag of a run of ``entry``'s trainer; a short form only where it is unambiguous."""
    options: list[Option] = [Option(("trainer", "name"), ["--trainer", "--trainer.name"],
                                    "The trainer (see `comlrl trainers`).", as_string=True)]
    docs = _docs(entry.config)
    for f in dataclasses.fields(entry.config):
        kind = _type_name(f.type).replace("typing.", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        options.append(Option(("trainer", "args", f.name), [f"--{f.name}", f"--trainer.args.{f.name}"],
                              f"{docs.get(f.name, '')} [default: {default!r}]",
                              as_string=kind in ("str", "Optional[str]"), boolean=kind == "bool"))
    for name, p in init_parameters(entry.trainer).items():
        if name != "args":
            options.append(Option(("trainer", name), [f"--trainer.{name}"],
                                  f"The trainer's {name} argument ({_KIND_HELP[_param_kind(name, p)]})."))
    for name in list(train_parameters(entry.trainer)) + list(TRAIN_EXTRAS):
        flags = [f"--{name}", f"--train.{name}"]
        if name == "resume_from_checkpoint":
            flags.insert(0, "--resume")
        options.append(Option(("train", name), flags, TRAIN_DOCS.get(name) or TRAIN_EXTRAS.get(name, ""),
                              as_string=name in ("resume_from_checkpoint", "checkpoint_dir", "save_model"),
                              boolean=name == "merge_adapters"))
    options.extend(extra)
    # A short form claimed by two keys is dropped (the dotted forms stay).
    counts: dict[str, int] = {}
    for option in options:
        for flag in option.flags:
            counts[flag] = counts.get(flag, 0) + 1
    for option in options:
        option.flags = [flag for flag in option.flags if counts[flag] == 1]
        dashed = [flag.replace("_", "-") for flag in option.flags if "." not in flag and "_" in flag]
        option.flags += [flag for flag in dashed if flag not in counts]
    return options


def _add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> dict[str, Option]:
    group = parser.add_argument_group("config keys (each also a YAML key; dotted paths such as "
                                      "--trainer.train_dataset.split set any other key)")
    by_dest = {}
    for index, option in enumerate(options):
        if not option.flags:
            continue
        dest = f"_opt{index}"
        by_dest[dest] = option
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": option.help.replace("%", "%%"),
                                  "metavar": "BOOL" if option.boolean else "VALUE"}
        if option.boolean:
            kwargs.update(nargs="?", const="true")
        group.add_argument(*option.flags, **kwargs)
    return by_dest


def parse_run_args(argv: Sequence[str], prog: str, usage: str, description: str,
                   add_fixed: Callable[[argparse.ArgumentParser], None],
                   require_config: bool = True) -> tuple[argparse.Namespace, Document, TrainerEntry]:
    """Parse ``comlrl train|export`` arguments: the fixed ones, the config file, and every override.

    The trainer (from the config or ``--trainer``) decides which flags exist, so the arguments are
    read twice: once for the config and the trainer, then with that trainer's flags."""
    first = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_fixed(first)
    first.add_argument("--trainer", "--trainer.name", dest="_trainer", default=None)
    first.add_argument("-h", "--help", action="store_true", dest="_help")
    known, _ = first.parse_known_args(_split_other_flags(argv, {f for a in first._actions
                                                                 for f in a.option_strings})[0])
    config_path = getattr(known, "config", None)
    doc = load_document(config_path) if config_path else Document(data={})
    section = doc.data.get("trainer")
    name = known._trainer or (section.get("name") if isinstance(section, dict) else None)
    if isinstance(section, dict):  # `train_dataset: file.jsonl` is `{path: file.jsonl}`: flags may add keys
        for param, value in section.items():
            if isinstance(param, str) and param.endswith("_dataset") and isinstance(value, str):
                section[param] = {"path": value}
                if ("trainer", param) in doc.lines:
                    doc.lines[("trainer", param, "path")] = doc.lines[("trainer", param)]
    try:
        entry = lookup_trainer(name if name is not None else "MAGRPO", [doc.base_dir, Path.cwd()])
    except ValueError as exc:
        if known._help:
            entry = lookup_trainer("MAGRPO")
        else:
            raise doc.error(("trainer", "name"), str(exc)) from None
    parser = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False, usage=usage,
        epilog=f"Flags listed for trainer {entry.name} ({entry.config.__name__}); pass a config or --trainer NAME "
               "for another trainer's. A flag's value is read as YAML: 8, 1e-3, null, [a, b].")
    add_fixed(parser)
    by_dest = _add_options(parser, options_for(entry))
    if known._help:
        parser.print_help()
        raise SystemExit(0)
    if require_config and not config_path:
        parser.error("the config file is required")
    known_flags = {flag for action in parser._actions for flag in action.option_strings}
    rest, other = _split_other_flags(argv, known_flags)
    ns = parser.parse_args(rest)
    for dest, option in by_dest.items():
        if hasattr(ns, dest):
            doc.set(option.key, parse_value(getattr(ns, dest), option.as_string), option.flags[0])
            delattr(ns, dest)
    for flag, value in other:
        _dotted_override(doc, flag, value, sorted(known_flags))
    return ns, doc, entry


def _split_other_flags(argv: Sequence[str], known: set[str]) -> tuple[list[str], list[tuple[str, Optional[str]]]]:
    """``argv`` without the ``--flag [value]`` pairs whose flag ``known`` lacks, and those pairs.

    Used twice: the first pass (which knows only the fixed flags) must never take an override's
    value for the config file (``comlrl train --seed 3 run.yaml``), and dotted keys
    (``--trainer.train_dataset.split test``) are not argparse options."""
    kept: list[str] = []
    other: list[tuple[str, Optional[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, has_value, inline = token.partition("=")
        if token == "--" or not token.startswith("--") or flag in known:
            kept.append(token)
            i += 1
        elif has_value:
            other.append((flag, inline))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            other.append((flag, argv[i + 1]))
            i += 2
        else:
            other.append((flag, None))
            i += 1
    return kept, other


def _dotted_override(doc: Document, flag: str, value: Optional[str], known_flags: list[str]) -> None:
    """``--a.b.c VALUE``: set any key of the config by its dotted path."""
    if "." not in flag or flag[2:].split(".")[0] not in SECTIONS:
        guess = difflib.get_close_matches(flag, known_flags, n=1)
        hint = f" (did you mean {guess[0]}?)" if guess else ""
        raise CliError(f"unrecognized argument {flag!r}{hint}. Config keys are flags: --num_generations 8, "
                       "--trainer.train_dataset.split test.")
    if value is None:
        raise CliError(f"{flag} needs a value.")
    key: Key = tuple(int(p) if p.isdigit() else p for p in flag[2:].split("."))
    doc.set(key, parse_value(value), flag)


# --- checking -------------------------------------------------------------------------------------

@dataclass
class RunSpec:
    """A checked run: the trainer, its config object, and the raw values of the other keys."""

    doc: Document
    entry: TrainerEntry
    config: Any
    trainer_values: dict[str, Any]
    train_values: dict[str, Any]


def _unknown(doc: Document, key: Key, known: Sequence[str], extra_hint: str = "",
             aliases: Optional[dict[str, str]] = None) -> CliError:
    name = str(key[-1])
    guess = (aliases or {}).get(name) if (aliases or {}).get(name) in known else None
    guess = guess or next(iter(difflib.get_close_matches(name, list(known), n=1)), None)
    if guess and not extra_hint:
        return doc.error(key, f"unknown key (did you mean {guess!r}?).")
    return doc.error(key, f"unknown key{extra_hint}. Known keys here: {', '.join(known)}.")


def _mapping(doc: Document, key: Key, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise doc.error(key, f"must be a mapping of names to values, got {type(value).__name__} {value!r:.60}.")
    return value


def check_run(doc: Document, entry: Optional[TrainerEntry] = None) -> RunSpec:
    """Check every key of ``doc`` and build the config object. Raises CliError naming the key."""
    data = _mapping(doc, (), doc.data)
    for section in data:
        if section not in SECTIONS:
            if entry is not None and any(f.name == section for f in dataclasses.fields(entry.config)):
                raise doc.error((section,), f"unknown key; {section} is a config field: write it under "
                                            f"trainer.args ({entry.config.__name__}).")
            raise _unknown(doc, (section,), SECTIONS)
    trainer = _mapping(doc, ("trainer",), data.get("trainer"))
    if "name" not in trainer:
        raise doc.error(("trainer", "name"), "missing: name the trainer, e.g. `name: MAGRPO` (see `comlrl trainers`).")
    try:
        entry = lookup_trainer(trainer["name"], [doc.base_dir, Path.cwd()])
    except ValueError as exc:
        raise doc.error(("trainer", "name"), str(exc)) from None
    params = init_parameters(entry.trainer)
    field_names = [f.name for f in dataclasses.fields(entry.config)]
    for name in trainer:
        if name not in params and name != "name":
            hint = f" ({name} is a config field: write it under trainer.args)" if name in field_names else ""
            raise _unknown(doc, ("trainer", name), ["name"] + list(params), hint)
    values = {k: v for k, v in trainer.items() if k not in ("name", "args")}
    config = _build_config(doc, entry, _mapping(doc, ("trainer", "args"), trainer.get("args")), values)
    train = _mapping(doc, ("train",), data.get("train"))
    train_known = [n for n in train_parameters(entry.trainer)] + list(TRAIN_EXTRAS)
    for name in train:
        if name not in train_known:
            raise _unknown(doc, ("train", name), train_known)
    return RunSpec(doc, entry, config, values, dict(train))


def _build_config(doc: Document, entry: TrainerEntry, args: dict[str, Any], values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(entry.config)}
    from ..engine.config import ALIASES

    for name, value in args.items():
        if name not in fields:
            raise _unknown(doc, ("trainer", "args", name), list(fields), aliases=ALIASES)
        check = fields[name].metadata.get("check")
        if check is not None:
            try:
                check(name, value)
            except ConfigError as exc:
                raise doc.error(("trainer", "args", name), _strip_name(str(exc), name)) from None
    args = dict(args)
    if "num_agents" in fields:
        _agree_on_agent_count(doc, args, values)
    try:
        return entry.config(**args)
    except ConfigError as exc:
        key = _mentioned(str(exc), [("trainer", "args", n) for n in args] + [("trainer", "args", n) for n in fields])
        raise doc.error(key or ("trainer", "args"), _strip_name(str(exc), str(key[-1]) if key else "")) from None
    except (TypeError, ValueError) as exc:  # a config class that is not ours
        raise doc.error(("trainer", "args"), _one_line(str(exc))) from None


def _agree_on_agent_count(doc: Document, args: dict[str, Any], values: dict[str, Any]) -> None:
    """``trainer.num_agents`` (or the length of ``trainer.agents``) also sets the config's count,
    so that the config saved with every checkpoint says how many agents were trained."""
    count = values.get("num_agents")
    agents = values.get("agents")
    if count is None and isinstance(agents, list):
        count = len(agents)
    if count is None:
        return
    if "num_agents" not in args:
        args["num_agents"] = count
    elif args["num_agents"] != count:
        source = "trainer.num_agents" if values.get("num_agents") is not None else "the length of trainer.agents"
        raise doc.error(("trainer", "args", "num_agents"), f"is {args['num_agents']!r} but {source} is {count!r}; "
                                                           "set one of them.")


def _strip_name(message: str, name: str) -> str:
    """``num_generations must be ...`` -> ``must be ...`` (the location already names the field)."""
    message = _one_line(message)
    return message[len(name) + 1:] if message.startswith(name + " ") else message


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _mentioned(message: str, keys: Sequence[Key]) -> Optional[Key]:
    """The first of ``keys`` whose name the message mentions as a word."""
    for key in keys:
        if re.search(rf"(?<![\w.]){re.escape(str(key[-1]))}(?!\w)", message):
            return key
    return None


def locate_error(spec: RunSpec, exc: BaseException) -> str:
    """An error from building or training the trainer, with the key it names if it names one."""
    message = _one_line(str(exc))
    keys = ([("trainer", "args", k) for k in _mapping(spec.doc, (), spec.doc.data.get("trainer", {})).get("args") or {}]
            + [("trainer", k) for k in spec.trainer_values] + [("train", k) for k in spec.train_values]
            + [("trainer", "args", f.name) for f in dataclasses.fields(spec.entry.config)])
    key = _mentioned(message, keys) if isinstance(exc, ConfigError) else None
    return f"{spec.doc.where(key)}: {message}" if key else message


# --- building -------------------------------------------------------------------------------------

def _param_kind(name: str, param: Optional[inspect.Parameter]) -> str:
    annotation = _type_name(param.annotation) if param is not None else ""
    if name.endswith("_dataset"):
        return "dataset"
    if name == "tokenizer" or name.endswith("_tokenizer"):
        return "tokenizer"
    if name == "peft_config":
        return "peft"
    if name.endswith("_config") or name.endswith("_kwargs"):
        return "plain"
    if name in ("agents", "critics") or name.endswith("_model") or name.endswith("_models"):
        return "model"
    if name in _CALLABLES or "Callable" in annotation:
        return "callable"
    return "object"


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
    bases = [doc.base_dir, Path.cwd()]
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
    return value


def _tokenizer(doc: Document, key: Key, value: Any) -> Any:
    source = _model_source(doc, key, value)
    if not isinstance(source, str):
        return source
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise doc.error(key, f"cannot load a tokenizer from {value!r}: {_one_line(str(exc))}") from None


def _peft(doc: Document, key: Key, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    try:
        from peft import LoraConfig
    except ImportError:
        raise doc.error(key, "LoRA agents need peft: pip install 'comlrl[peft]'.") from None
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
