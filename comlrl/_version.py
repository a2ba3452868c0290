"""The package's version (``comlrl.__version__``), the one place it is written: pyproject.toml
reads it from here (setuptools' ``attr:``, without importing the package).

2.x: comlrl keeps the public API of CoMLRL 1.4.3 (README, "comlrl and CoMLRL"), so its version
sorts above 1.4.3 and ``pip install -U`` of an extra never swaps it for the PyPI release."""

__version__ = "2.0.0"

__all__ = ["__version__"]
