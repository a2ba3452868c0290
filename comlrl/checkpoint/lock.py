"""An exclusive, crash-safe lock on a checkpoint directory.

The lock is an OS file lock (``flock``) on ``<dir>/.comlrl.lock``: the kernel releases it when the
holding process exits, however it exits (kill -9 included), so a directory is never left locked by
a dead run. The file also records who holds it, for the error a second run gets.

The lock file is opened without following links and must be a regular file of its own: a
``.comlrl.lock`` planted as a link to another file would otherwise make the run truncate that file.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .._io import open_regular
from ..exceptions import CheckpointDirError

__all__ = ["DirectoryLock", "LOCK_FILE"]

LOCK_FILE = ".comlrl.lock"


class DirectoryLock:
    """Hold ``directory`` exclusively until :meth:`release` or process exit.

    Raises:
        CheckpointDirError: another run (this process or another) holds it; nothing is touched.
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file where the directory (or one above it) would be
            raise CheckpointDirError(f"checkpoint_dir {self.path.parent} is not a directory (it or a folder above it "
                                     "is a file); nothing was touched. Point checkpoint_dir at a directory.") from None
        self._fd: Optional[int] = open_regular(self.path, os.O_RDWR | os.O_CREAT, "the lock file", CheckpointDirError)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise CheckpointDirError(
                f"{self.path.parent} is in use by another training run ({holder}); nothing was touched. Wait "
                "for it to finish or stop it, or use another checkpoint_dir.") from None
        try:
            self._record_holder()
        except OSError as exc:  # a full disk: the lock must not outlive this failure (the next train() would
            self.release()      # be told that "another run" holds the directory)
            raise CheckpointDirError(f"could not write the lock file {self.path}: {exc.strerror or exc}. Free space "
                                     "on that file system (a save needs about the size of one checkpoint) or use "
                                     "another checkpoint_dir.") from exc

    def _record_holder(self) -> None:
        """Write who holds the lock, for the error a second run gets."""
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps(info).encode("utf-8"))
        os.fsync(self._fd)

    def _holder(self) -> str:
        try:
            info = json.loads(os.pread(self._fd, 4096, 0).decode("utf-8") or "{}")
            return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
        except (OSError, ValueError, AttributeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
