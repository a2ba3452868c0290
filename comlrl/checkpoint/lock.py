"""An exclusive, crash-safe lock on a checkpoint directory.

The lock is an OS file lock (``flock``) on ``<dir>/.comlrl.lock``: the kernel releases it when the
holding process exits, however it exits (kill -9 included), so a directory is never left locked by
a dead run. The file also records who holds it, for the error a second run gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise CheckpointDirError(
                f"{self.path.parent} is in use by another training run ({holder}); nothing was touched. Wait "
                "for it to finish or stop it, or use another checkpoint_dir.") from None
        os.ftruncate(self._fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.write(self._fd, json.dumps(info).encode("utf-8"))
        os.fsync(self._fd)

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
        except (OSError, ValueError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
