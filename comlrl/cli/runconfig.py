"""A run described in YAML: its layout, its flags, and checking it (:mod:`comlrl.cli.build` builds
the trainer from it).

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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..exceptions import ConfigError, DataError
from .registry import TrainerEntry, init_parameters, lookup_trainer, train_parameters
from .._redact import is_secret_container, is_secret_name, redact
from .yamlconf import CliError, Document, Key, dotted, load_document, parse_value

__all__ = ["RunSpec", "Option", "options_for", "parse_run_args", "check_run", "locate_error", "TRAIN_EXTRAS"]

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


def options_for(entry: TrainerEntry, extra: Sequence[Option] = (), train_section: bool = True) -> list[Option]:
    """Every flag of a run of ``entry``'s trainer (without ``train:``'s when ``train_section`` is
    False: commands that do not train); a short form only where it is unambiguous."""
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
    for name in (list(train_parameters(entry.trainer)) + list(TRAIN_EXTRAS)) if train_section else ():
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


def _config_value(data: Any, key: Key) -> tuple[bool, Any]:
    """``(True, value)`` when the config ``data`` sets ``key``, else ``(False, None)``."""
    for part in key:
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def _add_options(parser: argparse.ArgumentParser, options: Sequence[Option], config: Any = None) -> dict[str, Option]:
    """The flags of ``options``; with a ``config`` (its data), each help text says the value the
    config sets, which is what a run without that flag gets."""
    group = parser.add_argument_group("config keys (each also a YAML key; dotted paths such as "
                                      "--trainer.train_dataset.split set any other key)")
    by_dest = {}
    for index, option in enumerate(options):
        if not option.flags:
            continue
        dest = f"_opt{index}"
        by_dest[dest] = option
        text = option.help
        found, value = _config_value(config, option.key)
        if found:
            text = f"{text} [this config: {value!r:.60}]"
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": text.replace("%", "%%"),
                                  "metavar": "BOOL" if option.boolean else "VALUE"}
        if option.boolean:
            kwargs.update(nargs="?", const="true")
        group.add_argument(*option.flags, **kwargs)
    return by_dest


def parse_run_args(argv: Sequence[str], prog: str, usage: str, description: str,
                   add_fixed: Callable[[argparse.ArgumentParser], None], require_config: bool = True,
                   train_section: bool = True,
                   default_trainer: Optional[Callable[[argparse.Namespace], Optional[str]]] = None,
                   ) -> tuple[argparse.Namespace, Document, TrainerEntry]:
    """Parse ``comlrl train|export`` arguments: the fixed ones, the config file, and every override.

    The trainer (from ``--trainer``, else the config, else ``default_trainer`` of the fixed
    arguments, else MAGRPO) decides which flags exist, so the arguments are read twice: once for
    the config and the trainer, then with that trainer's flags."""
    refuse_secret_arguments(argv)
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
    if name is None and default_trainer is not None:
        name = default_trainer(known)
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
    by_dest = _add_options(parser, options_for(entry, train_section=train_section), doc.data)
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
        _dotted_override(doc, flag, value, sorted(known_flags), entry)
    return ns, doc, entry


def refuse_secret_arguments(argv: Sequence[str]) -> None:
    """Refuse a secret on the command line: argv is recorded by W&B (its run files), shell history
    and ``ps``, which the config file and the environment are not. A flag naming a secret field
    (``--comparator_api_key``, headers, an extra request body) or a value shaped like a credential
    (or a URL carrying a query) is a CliError before anything is read or started."""
    for token in argv:
        flag, has_value, inline = token.partition("=")
        if token.startswith("--") and any(is_secret_name(p) or is_secret_container(p) for p in flag[2:].split(".")):
            field = flag[2:].split(".")[-1]
            env = f"; set {field}_env to the name of an environment variable holding it" if field.endswith("key") \
                else ""
            raise CliError(f"{flag} carries a secret, and the command line is recorded (W&B's run files, shell history, "
                           f"ps){env}, or write it in the YAML config. Nothing was started.")
        if token.startswith("--") and not has_value:
            continue
        value = inline if token.startswith("--") else token
        shown = _hidden(value)
        if shown != value:
            raise CliError(f"an argument carries a credential (by its shape, a URL query, or a secret key inside a YAML "
                           f"value: {shown!r:.120}), and the command line is recorded (W&B's run files, shell "
                           "history, ps); write it in the YAML config (or an environment variable the config names). "
                           "Nothing was started.")


def _hidden(value: str) -> Any:
    """A command-line value with its secrets hidden (by shape, or as YAML: ``{api_key: ...}``);
    ``value`` itself when it holds none."""
    shown = redact(value)
    if shown != value:
        return shown
    try:
        parsed = parse_value(value)
    except CliError:  # a YAML bomb: refused later, with its own message
        return value
    return redact(parsed) if isinstance(parsed, (dict, list)) and redact(parsed) != parsed else value


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


def _dotted_override(doc: Document, flag: str, value: Optional[str], known_flags: list[str],
                     entry: TrainerEntry) -> None:
    """``--a.b.c VALUE``: set any key of the config by its dotted path."""
    if "." not in flag or flag[2:].split(".")[0] not in SECTIONS:
        # a constructor argument's own name (--train_dataset) is its dotted key; spelling alone would pick
        # another flag that looks alike (--trainer.eval_dataset)
        head = flag[2:].split(".")[0]
        own = f"--trainer.{flag[2:]}" if head in init_parameters(entry.trainer) else None
        guess = [own] if own else difflib.get_close_matches(flag, known_flags, n=1)
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
    """An error from building or training the trainer, with the key it names if it names one (a
    message of several lines, such as a resume mismatch's list of differences, keeps its lines)."""
    message = str(exc).strip()
    keys = ([("trainer", "args", k) for k in _mapping(spec.doc, (), spec.doc.data.get("trainer", {})).get("args") or {}]
            + [("trainer", k) for k in spec.trainer_values] + [("train", k) for k in spec.train_values]
            + [("trainer", "args", f.name) for f in dataclasses.fields(spec.entry.config)])
    key = _mentioned(message, keys) if isinstance(exc, ConfigError) else None
    missing_prompt = re.match(r"(\w+_dataset) row \d+ has no 'prompt' column", message)
    if isinstance(exc, DataError) and missing_prompt and missing_prompt.group(1) in spec.trainer_values:
        key = ("trainer", missing_prompt.group(1))
        message = (f"{message.rstrip('.')}. In the config: {dotted(key)}.prompt_column names the column that holds "
                   f"the prompts ({{path: ..., prompt_column: text}}), or {dotted(key)}.columns renames columns.")
    return f"{spec.doc.where(key)}: {message}" if key else message


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
