"""Trainers by name, found in the trainer packages: a new trainer family needs no CLI change.

A trainer is any class named ``<Name>Trainer`` exported by one of :data:`TRAINER_MODULES` that has
a dataclass config: its ``config_class`` attribute, else ``default_config_cls`` (CoMLRL 1.4.3's
name), else ``<Name>Config`` exported beside it. ``MAGRPO``, ``MAGRPOTrainer`` and ``magrpo`` all
name MAGRPO; ``package.module:MyTrainer`` names a trainer outside comlrl.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .refs import RefError, is_ref, resolve_ref

__all__ = ["TRAINER_MODULES", "TrainerEntry", "available_trainers", "lookup_trainer", "init_parameters",
           "train_parameters"]

logger = logging.getLogger("comlrl")

TRAINER_MODULES = ("comlrl.trainers", "comlrl.trainers.reinforce", "comlrl.trainers.actor_critic",
                   "comlrl.trainers.preference")


@dataclass(frozen=True)
class TrainerEntry:
    """A trainer class, its config class and the name it is listed under."""

    name: str
    trainer: type
    config: type
    family: str

    def describe(self) -> str:
        """The docstring's first sentence, as plain text."""
        doc = inspect.getdoc(self.trainer) or ""
        paragraph = " ".join(doc.split("\n\n")[0].split())
        sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
        return re.sub(r":\w+:`~?([^`]+)`", r"\1", sentence).replace("``", "")


def _config_of(cls: type, namespace: Any) -> Optional[type]:
    for candidate in (getattr(cls, "config_class", None), getattr(cls, "default_config_cls", None),
                      getattr(namespace, cls.__name__[:-len("Trainer")] + "Config", None)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def available_trainers() -> tuple[dict[str, TrainerEntry], dict[str, str]]:
    """``({name: entry}, {module: why it could not be imported})`` over :data:`TRAINER_MODULES`."""
    found: dict[str, TrainerEntry] = {}
    failed: dict[str, str] = {}
    for module_name in TRAINER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a family that fails to import must not take the others down
            failed[module_name] = f"{type(exc).__name__}: {exc}"
            logger.debug("comlrl: cannot import %s: %s", module_name, exc)
            continue
        for attr in getattr(module, "__all__", dir(module)):
            entry = _entry(module, attr)
            if entry is not None and entry.name not in found:
                found[entry.name] = entry
    return found, failed


def _entry(module: Any, attr: str) -> Optional[TrainerEntry]:
    """The trainer ``module.attr`` (loading its family), or None if it is none."""
    if not attr.endswith("Trainer") or attr == "Trainer":
        return None
    cls = getattr(module, attr, None)
    config = _config_of(cls, module) if isinstance(cls, type) else None
    if config is None:
        return None
    family = cls.__module__.split(".")[2] if cls.__module__.startswith("comlrl.trainers.") else ""
    return TrainerEntry(attr[:-len("Trainer")], cls, config, family)


def _named_trainer(wanted: str) -> Optional[TrainerEntry]:
    """The trainer spelled ``wanted`` (any case), loading only its family: the package facades list
    their names without importing them."""
    for module_name in TRAINER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - available_trainers() reports it
            continue
        for attr in getattr(module, "__all__", ()):
            if attr.lower() == f"{wanted}trainer".lower():
                try:
                    entry = _entry(module, attr)
                except Exception:  # noqa: BLE001 - its family does not import: available_trainers() says why
                    entry = None
                if entry is not None:
                    return entry
    return None


def lookup_trainer(name: Any, base_dirs: Sequence[Path] = ()) -> TrainerEntry:
    """The trainer ``name`` stands for; ValueError with the known names if none."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"must be a trainer name such as 'MAGRPO', got {name!r}.")
    if is_ref(name):
        try:
            cls = resolve_ref(name, base_dirs)
        except RefError as exc:
            raise ValueError(str(exc)) from None
        module = importlib.import_module(cls.__module__) if isinstance(cls, type) else None
        config = _config_of(cls, module) if isinstance(cls, type) and cls.__name__.endswith("Trainer") else None
        if config is None:
            raise ValueError(f"{name} is not a trainer class named <Name>Trainer with a dataclass config "
                             "(config_class attribute).")
        return TrainerEntry(cls.__name__[:-len("Trainer")], cls, config, "")
    wanted = name.strip()
    wanted = wanted[:-len("Trainer")] if wanted.endswith("Trainer") else wanted
    entry = _named_trainer(wanted)
    if entry is not None:
        return entry
    found, failed = available_trainers()
    by_lower = {key.lower(): entry for key, entry in found.items()}
    if wanted.lower() in by_lower:
        return by_lower[wanted.lower()]
    guess = difflib.get_close_matches(wanted.lower(), list(by_lower), n=1)
    hint = f" (did you mean {by_lower[guess[0]].name!r}?)" if guess else ""
    broken = "".join(f" ({module} could not be imported: {why})" for module, why in failed.items())
    raise ValueError(f"unknown trainer {name!r}{hint}. Known trainers: {', '.join(sorted(found))}{broken}.")


def _signature_parameters(function: Any, skip: set[str]) -> tuple[dict[str, inspect.Parameter], bool]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return {}, True
    params, forwards = {}, False
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            forwards = True
        elif p.kind is not inspect.Parameter.VAR_POSITIONAL and p.name not in skip:
            params[p.name] = p
    return params, forwards


def init_parameters(trainer: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments ``trainer(...)`` accepts, following ``**kwargs`` that are forwarded
    to the parent class (the usual pattern of a subclass that adds a few arguments)."""
    params: dict[str, inspect.Parameter] = {}
    for cls in trainer.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        own, forwards = _signature_parameters(vars(cls)["__init__"], {"self"})
        for name, p in own.items():
            params.setdefault(name, p)
        if not forwards:
            break
    return params


def train_parameters(trainer: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments of ``trainer.train(...)``."""
    params, _ = _signature_parameters(getattr(trainer, "train"), {"self"})
    return params
