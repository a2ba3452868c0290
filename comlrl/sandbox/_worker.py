"""One sandbox worker: a zygote process (:mod:`._runtime.server`) and the pipe to it.

The zygote is a fresh interpreter started with a minimal environment (nothing of the trainer's,
so no secret reaches it or anything it forks), in its own session, running the stdlib-only code of
``_runtime/`` loaded by path (importing ``comlrl`` there would import torch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..exceptions import SandboxError
from ._runtime import cgroups, cleanup, frames

__all__ = ["Worker"]

RUNTIME = Path(__file__).resolve().parent / "_runtime"
_BOOT = (
    "import importlib.util, sys\n"
    "sys.path[:] = [p for p in sys.path if p]\n"  # no working directory on the path
    "d = sys.argv[1]\n"
    "spec = importlib.util.spec_from_file_location('comlrl_sandbox_runtime', d + '/__init__.py', "
    "submodule_search_locations=[d])\n"
    "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)\n"
    "from comlrl_sandbox_runtime.server import main\n"
    "main()\n"
)
# The whole environment of a worker. PYTHONHASHSEED fixed: set order, and so program output and
# rewards, do not vary between runs (a resumed run must score like the uninterrupted one).
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1"}
_SLACK_S = 30.0  # beyond a request's own deadline, before a silent worker is given up
_SEND_S = 30.0   # for the worker to take in a request (a handler reads each one as soon as the last is done)


class Worker:
    """A zygote, started on first use and restarted after it dies."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings
        self.proc: Optional[subprocess.Popen] = None
        self.base_dir: Optional[str] = None
        self.report: Optional[dict[str, Any]] = None

    def start(self) -> dict[str, Any]:
        """Start the zygote if needed; its isolation report (``active``/``reasons`` per mechanism)."""
        if self.proc is not None and self.proc.poll() is None:
            return self.report  # type: ignore[return-value]
        self.stop()
        self.base_dir = tempfile.mkdtemp(prefix="comlrl-sandbox-")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-s", "-B", "-c", _BOOT, str(RUNTIME)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env=dict(_ENV), cwd=self.base_dir, close_fds=True, start_new_session=True)
            os.set_blocking(self.proc.stdin.fileno(), False)  # writes have a deadline
            frames.write_frame(self.proc.stdin.fileno(), {**self.settings, "base_dir": self.base_dir,
                                                           "sys_path": [p for p in sys.path if p]},
                               time.monotonic() + 60)
            self.report = frames.FrameReader(self.proc.stdout.fileno(), 1 << 20).read(time.monotonic() + 60)
        except (OSError, frames.Closed, frames.Timeout) as exc:
            self.stop()
            raise SandboxError(f"the sandbox worker did not start ({type(exc).__name__}: {exc}); "
                               f"python: {sys.executable}") from None
        return self.report

    def request(self, header: dict[str, Any], body: Optional[dict[str, Any]], timeout_s: float) -> Optional[dict]:
        """Send one request; its answer, or None when the worker died or went silent (it is
        stopped and restarts at the next request)."""
        self.start()
        assert self.proc is not None
        try:
            frames.write_frame(self.proc.stdin.fileno(), header, time.monotonic() + _SEND_S)
            if body is not None:
                frames.write_frame(self.proc.stdin.fileno(), body, time.monotonic() + _SEND_S)
            return frames.FrameReader(self.proc.stdout.fileno(), 1 << 31).read(time.monotonic() + timeout_s + _SLACK_S)
        except (OSError, frames.Closed, frames.Timeout):
            self.stop()
            return None

    def stop(self) -> None:
        """End the zygote (and with it whatever it runs) and remove its folder and cgroup. Never
        raises: whatever a program left behind, the worker starts afresh next time."""
        proc, self.proc = self.proc, None
        base_dir, self.base_dir = self.base_dir, None
        groups = (self.report or {}).get("cgroups") or []
        self.report = None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=5)  # EOF on its stdin ends it between requests
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        if groups:
            cgroups.remove_paths([str(g) for g in groups])  # those its zygote could not remove (killed)
        if base_dir is not None:
            cleanup.remove_tree(base_dir)
