"""Removing a folder a program wrote, whatever it holds.

The tree is the program's: any depth (no recursion here, so no RecursionError, and one directory
open at a time, so no EMFILE), directories it made unreadable or unwritable, and symbolic links
to anything. Nothing is ever done through a link: entries are unlinked by name relative to an
open directory, and a directory is opened, and made accessible again, only as a directory opened
with O_NOFOLLOW (a chmod by path, as shutil.rmtree's error handlers do, would follow a link the
program planted and change a file outside). Used by the handler after each request and by the
worker for its folder; never raises.
"""

from __future__ import annotations

import os
import stat

__all__ = ["remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """``name`` opened as a directory (never through a link), made accessible first if it is not;
    None when that fails."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        pass
    except OSError:
        return None
    try:  # mode 000 or the like: chmod the directory itself through an O_PATH descriptor of it
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(handle)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _unlink(name: str, fd: int, is_dir: bool) -> bool:
    for attempt in range(2):
        try:
            (os.rmdir if is_dir else os.unlink)(name, dir_fd=fd)
            return True
        except FileNotFoundError:
            return True
        except PermissionError:
            if attempt:
                return False
            try:
                os.fchmod(fd, 0o700)  # the directory holding it, opened with O_NOFOLLOW
            except OSError:
                return False
        except OSError:
            return False
    return False


def _next_child(fd: int, stuck: set) -> tuple[str, bool] | None:
    """An entry of the directory ``fd`` not yet found impossible to remove: (name, is a directory)."""
    try:
        here = _identity(fd)
        with os.scandir(fd) as entries:
            for entry in entries:
                if (here, entry.name) in stuck:
                    continue
                try:
                    return entry.name, entry.is_dir(follow_symlinks=False)
                except OSError:
                    stuck.add((here, entry.name))
    except OSError:
        return None
    return None


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything beneath it; True when it is gone. A link or file at ``path``
    is removed itself, never followed."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        try:
            os.unlink(path)
            return True
        except OSError:
            return False
    fd = _open_dir(path, None)
    if fd is None:
        return False
    names: list[str] = []                 # the path from `path` down to the open directory
    parents: list[tuple[int, int]] = []   # (device, inode) of each directory above it
    stuck: set = set()                    # (directory, name) of entries that could not be removed
    try:
        while True:
            child = _next_child(fd, stuck)
            if child is not None:
                name, is_dir = child
                if not is_dir:
                    if not _unlink(name, fd, False):
                        stuck.add((_identity(fd), name))
                    continue
                below = _open_dir(name, fd)
                if below is None:
                    if not _unlink(name, fd, True):
                        stuck.add((_identity(fd), name))
                    continue
                parents.append(_identity(fd))
                names.append(name)
                os.close(fd)
                fd = below
                continue
            if not names:
                break
            # Everything removable here is gone: back up one level and remove this directory.
            try:
                up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            except OSError:
                return False
            os.close(fd)
            fd = up
            if _identity(fd) != parents.pop():
                return False  # moved while we were below (nothing should run now): stop
            name = names.pop()
            if not _unlink(name, fd, True):
                stuck.add((_identity(fd), name))
    finally:
        os.close(fd)
    return _unlink_top(path)


def _unlink_top(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
