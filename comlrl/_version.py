"""The installed package's version (``comlrl.__version__``), in a module of its own so that
internals can record it without importing the package's public facade."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("comlrl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
