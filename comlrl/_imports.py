"""Import on first use: the package facades (``comlrl``, ``comlrl.trainers``, ...) name their
exports here and load the module that defines one only when it is first asked for, so that
``import comlrl`` and ``comlrl --help`` do not pay for torch, transformers and every trainer.

Also the one place that says what to do when torch is missing: torch is an extra
(``torch``), since the right build (CPU or CUDA) is the user's choice, not ours.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

__all__ = ["lazy_exports", "require_torch", "install_hint", "TORCH_INSTALL_HINT"]

TORCH_INSTALL_HINT = ("comlrl does not install torch by itself, since the build (CPU or CUDA) is yours to choose: "
                      "pip install torch --index-url https://download.pytorch.org/whl/cpu on a CPU-only machine, "
                      "pip install torch for the default (CUDA on Linux) build; then retry.")


def require_torch(what: str) -> None:
    """Raise an ImportError that says how to install torch when it is not importable; ``what`` is
    the part of comlrl that needs it. Finding the module does not import it."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken torch on the path
        found = False
    if not found:
        raise ImportError(f"{what} needs torch. {TORCH_INSTALL_HINT}", name="torch")


def _checkout() -> Optional[Path]:
    """The source checkout comlrl runs from (an editable install), or None (installed from a wheel)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "comlrl" / "_imports.py").is_file() else None


def _extra_requirements(extra: str) -> list[str]:
    """The requirements of one extra as the installed metadata lists them (pyproject.toml is the source)."""
    from importlib import metadata

    try:
        listed = metadata.requires("comlrl") or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r";\s*extra\s*==\s*['\"]" + re.escape(extra) + r"['\"]\s*$")
    return [marker.sub("", r).strip() for r in listed if marker.search(r)]


@functools.lru_cache(maxsize=None)
def install_hint(extra: str) -> str:
    """How to install an extra of comlrl, for an error message. Never the PyPI form (the name comlrl
    with the extra in brackets): that name on PyPI is CoMLRL 1.4.3, which pip would put in comlrl's
    place. From a checkout, the extra of that checkout; else (or also) the extra's packages."""
    ways = []
    checkout = _checkout()
    if checkout is not None:
        ways.append(f"pip install -e {shlex.quote(f'{checkout}[{extra}]')}")
    packages = _extra_requirements(extra)
    if packages:
        ways.append("pip install " + " ".join(shlex.quote(p) for p in packages))
    return " or ".join(ways) or f"install the {extra!r} extra of comlrl from its source checkout"


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package whose ``exports`` map each public name to the
    module (relative to ``package``) that defines it. A loaded name is cached in the package. A
    subpackage is an attribute too, as when the facade imported it eagerly
    (``import comlrl; comlrl.trainers.reinforce.MAGRPOTrainer``)."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")  # the import sets the attribute
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where, package), name)
        importlib.import_module(package).__dict__[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(exports))

    return __getattr__, __dir__
