"""References to Python objects in configs: ``package.module:name`` or ``path/to/file.py:name``.

A file is imported once per process as module ``comlrl_files.<stem>``: the same name in every
run, so the reward function's fingerprint (its module and source) is the same when the run is
resumed, also from another working directory.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any, Sequence

__all__ = ["RefError", "is_ref", "resolve_ref", "find_path"]

_FILES_PACKAGE = "comlrl_files"
_loaded_files: dict[Path, types.ModuleType] = {}


class RefError(ValueError):
    """A reference that cannot be resolved (the caller adds where it was written)."""


def is_ref(value: Any) -> bool:
    """Whether ``value`` has the form of a reference (``something:name``)."""
    return isinstance(value, str) and ":" in value and bool(value.rsplit(":", 1)[1].strip())


def find_path(text: str, base_dirs: Sequence[Path]) -> Path | None:
    """``text`` as an existing path: absolute, or relative to the first of ``base_dirs`` holding it."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path if path.exists() else None
    for base in base_dirs:
        if (base / path).exists():
            return (base / path).resolve()
    return None


def resolve_ref(ref: str, base_dirs: Sequence[Path]) -> Any:
    """The object ``ref`` names. Relative files are looked up in ``base_dirs`` (the config's
    directory, then the working directory), which are also tried for modules not importable
    otherwise."""
    if not is_ref(ref):
        raise RefError(f"{ref!r} is not a reference; write 'package.module:name' or 'path/to/file.py:name'.")
    where, attribute = (part.strip() for part in ref.rsplit(":", 1))
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(where, base_dirs)
    else:
        module = _import_module(where, base_dirs)
    target: Any = module
    parts = attribute.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(target, part):
            owner = where if depth == 0 else f"{where}:{'.'.join(parts[:depth])}"
            names = [n for n in dir(target) if not n.startswith("_")]
            guess = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise RefError(f"{owner!r} has no attribute {part!r}{hint}.")
        target = getattr(target, part)
    return target


def _import_module(name: str, base_dirs: Sequence[Path]) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise RefError(f"importing module {name!r} failed: {exc}.") from None
    except Exception as exc:  # the user's module raised while importing
        raise RefError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from None
    for base in base_dirs:  # a module next to the config or in the working directory
        if str(base) not in sys.path:
            sys.path.insert(0, str(base))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            raise RefError(f"cannot import module {name!r} (no module named {exc.name!r}; looked on sys.path and "
                           f"in {', '.join(str(b) for b in base_dirs)}).") from None
        raise RefError(f"importing module {name!r} failed: {exc}.") from None
    except Exception as exc:
        raise RefError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from None


def _import_file(text: str, base_dirs: Sequence[Path]) -> types.ModuleType:
    path = find_path(text, base_dirs)
    if path is None or not path.is_file():
        raise RefError(f"file {text!r} not found (looked in {', '.join(str(b) for b in base_dirs)}).")
    path = path.resolve()
    if path in _loaded_files:
        return _loaded_files[path]
    if _FILES_PACKAGE not in sys.modules:
        package = types.ModuleType(_FILES_PACKAGE)
        package.__path__ = []  # a namespace for the files' modules
        sys.modules[_FILES_PACKAGE] = package
    stem = re.sub(r"\W", "_", path.stem) or "module"
    name, n = f"{_FILES_PACKAGE}.{stem}", 1
    while name in sys.modules:  # two files with one stem: the second gets a numbered name
        n += 1
        name = f"{_FILES_PACKAGE}.{stem}_{n}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RefError(f"cannot import {path} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:  # so the file can import its neighbours
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RefError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    _loaded_files[path] = module
    return module
