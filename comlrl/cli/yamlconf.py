"""YAML configs: loading with the line of every key, YAML 1.2 numbers, and error locations.

Every error the command line reports about a value names where the value came from: the file and
line of its key (``run.yaml:12: trainer.args.num_generations``) or the flag that set it
(``--num_generations (trainer.args.num_generations)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

__all__ = ["CliError", "Document", "Key", "load_document", "parse_value", "dotted"]

Key = tuple[Union[str, int], ...]


class CliError(Exception):
    """A mistake in the command line or its config: printed as one line, exit status 2."""


class _Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where ``1e-3`` (no dot) is a string; YAML 1.2 (and every user) reads a
    number, so that is what learning rates written that way become here."""


_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                        |[-+]?\.(?:inf|Inf|INF)
                        |\.(?:nan|NaN|NAN))$""", re.X)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def dotted(key: Key) -> str:
    """``("trainer", "args", "seed")`` -> ``trainer.args.seed``; list items as ``agents[1]``."""
    text = ""
    for part in key:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


@dataclass
class Document:
    """A config tree, where it came from, and where each key was set."""

    data: dict[str, Any]
    file: Optional[Path] = None                              # None: built from flags only
    lines: dict[Key, int] = field(default_factory=dict)      # key -> line in the file
    flags: dict[Key, str] = field(default_factory=dict)      # key -> the flag that set it
    label: Optional[str] = None                              # how errors name it, if not by its file
    also_in: tuple[Path, ...] = ()                           # more directories relative inputs may be in

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        return self.file.name if self.file is not None else "<command line>"

    @property
    def base_dir(self) -> Path:
        """Relative input paths (data files, .py files, model directories) are looked up here first."""
        return self.file.parent if self.file is not None else Path.cwd()

    def where(self, key: Key) -> str:
        """``file:line: key``, or ``--flag (key)`` for a value set on the command line."""
        for depth in range(len(key), 0, -1):
            if key[:depth] in self.flags:
                return f"{self.flags[key[:depth]]} ({dotted(key)})" if key else self.flags[key[:depth]]
        if key and self.lines and not self._holds(key):  # a default: not in the file (nor merged into it)
            return f"{self.name}: {dotted(key)} (not set in the file)"
        for depth in range(len(key), 0, -1):
            if key[:depth] in self.lines:
                return f"{self.name}:{self.lines[key[:depth]]}: {dotted(key)}"
        return f"{self.name}: {dotted(key)}" if key else self.name

    def _holds(self, key: Key) -> bool:
        node: Any = self.data
        for part in key:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                return False
        return True

    def error(self, key: Key, message: str) -> CliError:
        return CliError(f"{self.where(key)}: {message}")

    def set(self, key: Key, value: Any, flag: str) -> None:
        """Override ``key`` (from the command line), creating parent mappings as needed."""
        node: Any = self.data
        for depth, part in enumerate(key[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise CliError(f"{flag}: {self.where(key[:depth + 1])} is not a mapping, so it has no key "
                               f"{key[depth + 1]!r}; set {dotted(key[:depth + 1])} as a whole instead.")
            node = child
        node[key[-1]] = value
        self.flags[key] = flag


def load_document(path: Union[str, Path]) -> Document:
    """Read a YAML config (a mapping at the top) with the line of every key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read config file {path}: {exc}") from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[Key, int] = {}
        if node is not None:
            _check_expansion(node, path.name)
            _record_lines(node, (), lines, path.name)
        data = loader.construct_document(node) if node is not None else None
    except RecursionError:
        raise CliError(f"{path.name}: the YAML nests too deeply to be a config.") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f"{mark.line + 1}:" if mark is not None else ""
        raise CliError(f"{path.name}:{line} invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"{path.name}: invalid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CliError(f"{path.name}: the config must be a mapping of sections (trainer:, train:), got a "
                       f"{type(data).__name__}.")
    return Document(data=data, file=path.resolve(), lines=lines)


MAX_VALUES = 1_000_000  # values of a config with every alias expanded (what later steps walk)


def _check_expansion(root: yaml.Node, name: str) -> None:
    """Refuse a document whose aliases (``*anchor``) expand to more than :data:`MAX_VALUES` values
    (an "anchor bomb": a few lines that expand exponentially) or refer to themselves, before
    anything walks or copies it."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise CliError(f"{name}:{node.start_mark.line + 1}: an alias refers to the value that holds it (a "
                           "recursive anchor); a config must be finite.")
        open_nodes.add(key)
        children = ([part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                raise CliError(f"{name}: the YAML expands to more than {MAX_VALUES:,} values through its aliases "
                               "(&anchor / *alias: an anchor bomb?); write the values out or use fewer aliases.")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


def _record_lines(node: yaml.Node, key: Key, lines: dict[Key, int], name: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            part = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            if part in seen:  # PyYAML silently keeps the last one; a repeated key is always a mistake
                raise CliError(f"{name}:{key_node.start_mark.line + 1}: {dotted(key + (part,))}: duplicate key.")
            seen.add(part)
            lines[key + (part,)] = key_node.start_mark.line + 1
            _record_lines(value_node, key + (part,), lines, name)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[key + (index,)] = item.start_mark.line + 1
            _record_lines(item, key + (index,), lines, name)


def parse_value(text: str, as_string: bool = False) -> Any:
    """A flag's value as YAML (``8`` -> 8, ``1e-3`` -> 0.001, ``null`` -> None, ``[a, b]`` -> a list);
    ``as_string`` keeps it as written (``null`` / ``None`` still mean None)."""
    if as_string:
        return None if text in ("null", "None", "~") else text
    if not text.strip():
        return text
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, "a flag's value")
        return loader.construct_document(node)
    except (yaml.YAMLError, RecursionError):
        return text
    finally:
        loader.dispose()
