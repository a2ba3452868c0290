"""Choices registered by name: advantage estimators and policy losses (as verl's ``core_algos``
registers them). A new estimator or loss is one function and one name::

    from comlrl.extend import register_advantage

    @register_advantage("median")
    def median_baseline(returns, group_ids):   # float64 [N], int64 [N] -> float64 [N]
        ...

after which ``advantage_mode="median"`` selects it (a config's choices are those registered when
it is built). Looking up a name nobody registered raises a ``ValueError`` listing those that are.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Functions of one kind by name, with optional facts about each (``register(name, **facts)``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._facts: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *, replace: bool = False, **facts: Any) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; a name taken already is refused unless
        ``replace`` (so that two extensions cannot silently shadow each other)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")

        def add(fn: F) -> F:
            if name in self._entries and not replace and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered already (by {self._entries[name].__qualname__}); "
                                 "pass replace=True to replace it")
            self._entries[name] = fn
            self._facts[name] = dict(facts)
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as ``name``.

        Raises:
            ValueError: no function is registered as ``name`` (the message lists the names that are).
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(map(repr, self._entries))}") \
                from None

    def facts(self, name: str) -> dict[str, Any]:
        """What ``name`` was registered with (``register(name, **facts)``)."""
        self.get(name)
        return dict(self._facts[name])

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order they were registered."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
