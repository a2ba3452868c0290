"""Crash-safe file writing: write a temporary sibling, fsync, rename into place. And the rule for
every path the library writes inside a run directory: never through a symbolic link (a planted
``metrics.jsonl -> ~/.bashrc`` must not make training overwrite the link's target)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write_text", "fsync_dir", "fsync_tree", "move_into_place", "refuse_link", "own_dir",
           "open_regular", "read_regular", "temp_sibling"]


def refuse_link(path: str | os.PathLike, what: str, error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` when ``path`` is a symbolic link (dangling or not): the library
    never writes through one."""
    if os.path.islink(path):
        raise error(f"{what} {path} is a symbolic link (to {os.readlink(path)}); comlrl never writes through a "
                    "link in a run directory, since that would overwrite the link's target. Remove the link or "
                    "use another directory.")


def own_dir(path: str | os.PathLike, what: str, error: Callable[[str], Exception]) -> Path:
    """Create the folder ``path`` (and its parents) that the library writes into, refusing it when
    it is a symbolic link or not a directory. Returns it."""
    path = Path(path)
    refuse_link(path, what, error)
    if path.exists() and not path.is_dir():
        raise error(f"{what} {path} exists and is not a directory; move it away or use another directory.")
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_regular(path: str | os.PathLike, flags: int, what: str, error: Callable[[str], Exception],
                 mode: int = 0o644) -> int:
    """``os.open`` that never follows a symbolic link at ``path`` and accepts only a regular file
    with one name (a hard link to another file would be written through just the same).
    Returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        refuse_link(path, what, error)
        raise error(f"{what} {path} cannot be opened: {exc.strerror or exc}. Remove what is there or use another "
                    "directory.") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a hard link ({info.st_nlink} names)"
        raise error(f"{what} {path} is {kind}; comlrl writes only files of its own there. Remove it or use another "
                    "directory.")
    return fd


def read_regular(path: str | os.PathLike, what: str, error: Callable[[str], Exception]) -> bytes:
    """The bytes of the regular file at ``path``, opened without blocking and without following a
    link: a FIFO (which a plain open would wait on forever), a directory, a device or a link is
    refused with ``error(message)``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        refuse_link(path, what, error)
        raise error(f"{what} {path} cannot be read: {exc.strerror or exc}. Remove what is there or use another "
                    "directory.") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {path} is not a regular file (a FIFO, a directory or a device); comlrl keeps only files "
                    "of its own there. Remove it or use another directory.")
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def temp_sibling(path: str | os.PathLike, suffix: str = ".tmp") -> Path:
    """A new, empty, uniquely named hidden file beside ``path`` (created exclusively, so nothing
    planted at a guessable name can be written through)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    return Path(tmp)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (the rename itself) to disk; a no-op where the OS cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file below ``root``, then every directory (deepest first), then ``root``."""
    root = Path(root)
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        else:
            fsync_dir(path)
    fsync_dir(root)


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename a finished (fsynced) directory ``tmp`` to ``target``. An existing ``target`` is first
    renamed to a hidden ``.old-*`` sibling and deleted only after the new one is in place."""
    if target.exists():
        old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_dir(target.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves either the old or the new content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
