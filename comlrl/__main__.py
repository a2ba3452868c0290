"""``python -m comlrl``: the command line (see :mod:`comlrl.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
