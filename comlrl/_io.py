"""Crash-safe file writing: write a temporary sibling, fsync, rename into place."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

__all__ = ["atomic_write_text", "fsync_dir", "fsync_tree", "move_into_place"]


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
