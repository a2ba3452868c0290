"""The machinery every trainer config is built with: declared fields, checks, clear errors.

A config is a dataclass whose fields are declared with :func:`setting`, each with a one-line doc,
a check, and whether it may change when a run is resumed. Every check runs when the config is
built, every single-field check again when a field is assigned later (CoMLRL's configs are plain
mutable dataclasses, so ours are too), and the cross-field checks (:meth:`Config.validate`) when
the config is built and when a trainer starts. Any failure is a :class:`ConfigError` that names
the field and says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import Any, Callable, ClassVar, Iterable, Optional

from .._redact import REDACTED, redact, redact_text, secrets_in
from ..exceptions import ConfigError

__all__ = ["Config", "config_class", "setting", "check_int", "check_float", "check_bool", "check_choice",
           "optional", "resumable_fields"]

Check = Callable[[str, Any], Any]

# Names users of other libraries type, mapped to ours, for the "unknown field" message.
ALIASES = {
    "learning_rate": "agent_learning_rate",
    "lr": "agent_learning_rate",
    "per_device_train_batch_size": "train_batch_size",
    "batch_size": "train_batch_size",
    "num_epochs": "num_train_epochs",
    "epochs": "num_train_epochs",
    "grad_clip": "max_grad_norm",
    "max_completion_length": "max_new_tokens",
    "scale_rewards": "advantage_normalization",
    "group_size": "num_generations",
    "beta": "reference_kl_coef",
    "kl_coef": "reference_kl_coef",
    "bf16": "mixed_precision",
    "fp16": "mixed_precision",
    "termination_threshold": "early_termination_threshold",
    "device": "agent_devices",
    "gradient_accumulation_steps": "micro_batch_size",
    "logging_dir": "tensorboard_dir",
    "run_name": "mlflow_run_name",
}


def setting(default: Any, doc: str, check: Optional[Check] = None, may_change: bool = False,
            secret: bool = False) -> Any:
    """Declare a config field: its default, a one-line doc, an optional check (``check(name, value)``
    returns the value, possibly normalised, or raises ConfigError), whether it may differ between a
    checkpoint and the run that resumes it, and whether it is a secret (never written out:
    :meth:`Config.to_dict` shows it as ``"<redacted>"``; fields and nested keys that carry a
    secret by name or by value shape are hidden the same way, see :mod:`comlrl._redact`)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check, "may_change_on_resume": may_change,
                                                        "secret": secret})


# --- reusable checks ------------------------------------------------------------------------------

def check_int(minimum: int, maximum: Optional[int] = None) -> Check:
    """A check for an int (not a bool) in ``[minimum, maximum]``."""
    def check(name: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum or \
                (maximum is not None and value > maximum):
            bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise ConfigError(f"{name} must be an int {bound}, got {value!r}. Change {name}.")
        return value
    return check


def check_float(ok: Callable[[float], bool], what: str) -> Check:
    """A check for a finite number for which ``ok(value)`` holds; ``what`` says so in the error."""
    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ConfigError(f"{name} must be a number {what}, got {value!r}. Change {name}.")
        return float(value) if isinstance(value, float) else value
    return check


def check_bool(name: str, value: Any) -> bool:
    """The check of a True / False field."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}.")
    return value


def check_choice(*choices: str, aliases: Optional[dict[str, str]] = None, none_is: Optional[str] = None) -> Check:
    """One of ``choices`` (case and surrounding spaces ignored, ``aliases`` mapped); with
    ``none_is``, None or an empty string means that choice (CoMLRL's "None = the default")."""
    def check(name: str, value: Any) -> str:
        if none_is is not None and (value is None or value == ""):
            value = none_is
        key = value.strip().lower() if isinstance(value, str) else None  # choices are strings
        key = (aliases or {}).get(key, key)
        if key not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
        return key
    return check


def check_registered(registry: Any) -> Check:
    """A name registered in ``registry`` (a :class:`comlrl.functional.registry.Registry`) when the
    value is checked, so that a config can select what an extension registered (case and
    surrounding spaces ignored, as :func:`check_choice`)."""
    def check(name: str, value: Any) -> str:
        key = value.strip() if isinstance(value, str) else None
        key = key if key in registry or key is None else key.lower()
        if key not in registry:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, registry.names()))}; got {value!r}.")
        return key
    return check


def check_str(name: str, value: Any) -> str:
    """The check of a non-empty string field."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}.")
    return value


def optional(inner: Check) -> Check:
    """``inner``, or None."""
    def check(name: str, value: Any) -> Any:
        return None if value is None else inner(name, value)
    return check


# --- the base class ---------------------------------------------------------------------------

class Config:
    """Base of every trainer config (use with :func:`config_class`)."""

    #: ``{field: source}``: the field's ``None`` means "the source field's value" (CoMLRL's
    #: ``train_batch_size=None``: the buffer). Such a field follows later assignments of its source
    #: until it is given a value of its own. (``dataclasses.replace`` passes every current value
    #: explicitly, so its copy no longer follows: assign the source field on a copy instead.)
    DERIVED_DEFAULTS: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's ``DERIVED_DEFAULTS`` add to its parents' (never replace them)."""
        super().__init_subclass__(**kwargs)
        merged: dict[str, str] = {}
        for base in reversed(cls.__mro__[1:]):
            merged.update(base.__dict__.get("DERIVED_DEFAULTS", {}))
        cls.DERIVED_DEFAULTS = {**merged, **cls.__dict__.get("DERIVED_DEFAULTS", {})}

    def __post_init__(self) -> None:
        object.__setattr__(self, "_following", set())
        for name, source in self.DERIVED_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, source))
                self._following.add(name)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, self._checked(f, getattr(self, f.name)))
        self.validate()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not getattr(self, "_ready", False):
            object.__setattr__(self, name, value)
            return
        fields = {f.name: f for f in dataclasses.fields(self)}
        if name not in fields:
            raise ConfigError(_unknown_message(type(self), [name]))
        following = set(self._following)
        if name in self.DERIVED_DEFAULTS:
            if value is None:
                value = getattr(self, self.DERIVED_DEFAULTS[name])
                following.add(name)
            else:
                following.discard(name)
        object.__setattr__(self, name, self._checked(fields[name], value))
        for dependent in following:
            if self.DERIVED_DEFAULTS[dependent] == name:
                object.__setattr__(self, dependent, self._checked(fields[dependent], getattr(self, name)))
        object.__setattr__(self, "_following", following)

    @staticmethod
    def _checked(f: dataclasses.Field, value: Any) -> Any:
        check = f.metadata.get("check")
        try:
            return check(f.name, value) if check is not None else value
        except ConfigError as exc:  # the message quotes the value: never a secret in it
            hidden = [value] if f.metadata.get("secret") and isinstance(value, str) else []
            raise ConfigError(redact_text(str(exc), hidden + secrets_in(value, f.name))) from None

    def validate(self) -> None:
        """Cross-field invariants; subclasses extend it (and call ``super().validate()``)."""

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict (tuples become lists; secrets as ``"<redacted>"``: a set
        ``secret`` field, and any field or nested key carrying one by name or value shape, see
        :mod:`comlrl._redact`): what checkpoints, fingerprints and trackers record."""
        return {f.name: (REDACTED if f.metadata.get("secret") and getattr(self, f.name) is not None
                         else redact(_plain(getattr(self, f.name)), f.name)) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        """Every field as :meth:`to_dict` shows it: a repr never shows a secret."""
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Config":
        """Build from a dict (e.g. a checkpoint's saved config); unknown keys raise ConfigError."""
        return cls(**values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """``{field: one-line doc}``, for help texts (CLI, docs)."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _unknown_message(cls: type, unknown: Iterable[str]) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    hints = []
    for key in unknown:
        guess = ALIASES.get(key) if ALIASES.get(key) in names else None
        guess = guess or next(iter(difflib.get_close_matches(key, names, n=1)), None)
        hints.append(f"{key!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
    return f"{cls.__name__} has no field {', '.join(hints)}. Known fields: {', '.join(names)}."


def config_class(cls: type) -> type:
    """``@dataclass`` plus an ``__init__`` that names the closest real field for a misspelt one."""
    cls = dataclasses.dataclass(cls, repr=False)  # Config.__repr__ hides secrets
    names = {f.name for f in dataclasses.fields(cls)}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ConfigError(_unknown_message(cls, unknown))
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field's default value, as :meth:`Config.to_dict` would write it."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return {name: _plain(value) for name, value in out.items()}


def resumable_fields(cls: type) -> frozenset[str]:
    """Fields that may differ between a checkpoint and the run resuming it."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("may_change_on_resume"))
