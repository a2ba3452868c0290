"""``comlrl COMMAND ...``: dispatch, and how errors end a command.

A user error (a bad key or value, a missing file, a checkpoint that does not verify, a reward
function that raises) ends the command with one line on stderr and exit status 2; anything else
is a bug and keeps its traceback. ``COMLRL_DEBUG=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Callable, Iterator, Optional, Sequence

from ..exceptions import ComlrlError
from .yamlconf import CliError

__all__ = ["main"]

# Commands that build trainers or read checkpoints (torch tensors); `plot` reads metrics.jsonl only.
_NEEDS_TORCH = ("train", "checkpoints", "export", "trainers")
_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train the agents of a YAML config (--resume auto continues a run)"),
    "checkpoints": ("checkpoints", "list a directory's checkpoints and verify them"),
    "export": ("export", "write a checkpoint's agents as model directories"),
    "plot": ("plot", "plot a run's reward curves (metrics.jsonl) as a PNG"),
    "trainers": ("trainers", "list the trainers a config can name"),
}
USER_ERROR = 2


def _top_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="comlrl", description="Cooperative multi-agent RL for language models: the command line.",
        epilog="`comlrl COMMAND --help` for a command's options; docs/cli.md for the YAML layout.")
    parser.add_argument("--version", action="version", version=f"comlrl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


class _ProgressSafeHandler(logging.StreamHandler):
    """Log lines on stderr above a running progress bar instead of appended to its line."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


@contextlib.contextmanager
def _library_log_lines() -> Iterator[None]:
    """The library's INFO lines (resumed at epoch ..., checkpoint saved ...) on stderr while a
    command runs; the logger is left as it was (main() may run inside another program)."""
    logger = logging.getLogger("comlrl")
    if logger.handlers:  # the embedding program configured it
        yield
        return
    handler = _ProgressSafeHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(_COMMANDS)}")
        parser.parse_args(argv)  # --version / --help exit here
        parser.print_help()
        return USER_ERROR
    if argv[0] in _NEEDS_TORCH and "-h" not in argv and "--help" not in argv:
        from .._imports import require_torch

        try:
            require_torch(f"comlrl {argv[0]}")
        except ImportError as exc:
            print(f"comlrl {argv[0]}: error: {exc}", file=sys.stderr)
            return USER_ERROR
    from . import commands

    command: Callable[[Sequence[str]], int] = getattr(commands, _COMMANDS[argv[0]][0])
    try:
        with _library_log_lines():
            return command(argv[1:])
    except (CliError, ComlrlError) as exc:
        if os.environ.get("COMLRL_DEBUG"):
            raise
        print(f"comlrl {argv[0]}: error: {_error_text(exc)}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"comlrl {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `comlrl checkpoints DIR --json | head -3`: the reader has all it wanted
        try:  # Python's own flush of stdout at exit must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141  # as a process killed by SIGPIPE


def _error_text(exc: BaseException) -> str:
    """The error's message, each of its lines with its spaces collapsed and the following lines
    indented (a resume mismatch lists one difference per line)."""
    lines = [" ".join(line.split()) for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    return "\n  ".join(lines) or type(exc).__name__
