"""The zygote (Z): a pre-imported interpreter that forks every run and check.

Protocol on its stdin/stdout (length-prefixed JSON frames, :mod:`.frames`): the worker sends the
settings once and gets the isolation report; then per request a header frame
(``{"op": "run", "code", "stdin"}`` or ``{"op": "check", "code", "count"}``), for a check followed by
``{"tests", "setup"}``, which the zygote reads only after forking the request's init, so the
program's processes never hold the tests. The answer is one frame.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from . import child, frames, judge, layers

__all__ = ["main"]

# Imported once here so that a forked program need not import them again.
_PREIMPORT = ("math", "re", "itertools", "functools", "collections", "heapq", "bisect", "string", "random",
              "statistics", "fractions", "decimal", "typing", "copy", "operator", "datetime", "json", "hashlib",
              "array", "dataclasses", "enum", "textwrap", "unicodedata", "cmath", "traceback")


def main() -> None:
    config = frames.read_frame(0)
    z = layers.setup(config)
    for name in _PREIMPORT:
        importlib.import_module(name)
    gc.freeze()  # forked children then touch (copy) fewer of the zygote's pages
    frames.write_frame(1, {"active": z.active, "reasons": z.reasons, "pid": os.getpid()})
    while True:
        try:
            header = frames.read_frame(0)
        except frames.Closed:
            break
        handler = _run if header["op"] == "run" else _check
        frames.write_frame(1, handler(z, header))
    os._exit(0)


# --- one request -----------------------------------------------------------------------------------

def _workdir(z) -> str:
    path = tempfile.mkdtemp(prefix="run-", dir=z.base_dir)
    if z.uids is not None:
        os.chown(path, z.uids[0], z.uids[0])
    return path


def _remove(path: str) -> None:
    def unlock(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass
    shutil.rmtree(path, onerror=unlock)


def _entry(z, target, *args) -> None:
    """The start of a forked request process; a bug in trusted code is shown on the worker's stderr."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        target(z, *args)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(71)


def _fork(z, target, *args) -> int:
    pid = os.fork()
    if pid == 0:
        _entry(z, target, *args)
    return pid


def _fork_init(z, target, *args) -> int:
    """The request's init: PID 1 of a new PID namespace where that layer is on."""
    return layers.fork_in_new_pid_namespace(z, lambda: _entry(z, target, *args))


def _run(z, header: dict[str, Any]) -> dict[str, Any]:
    limits = {**z.limits, **header.get("limits", {})}
    workdir = _workdir(z)
    stdin_fd = os.memfd_create("stdin")
    frames.write_all(stdin_fd, header.get("stdin", "").encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    tag_r, tag_w = os.pipe()
    start = time.monotonic()
    init = _fork_init(z, child.init_run, header["code"], workdir, stdin_fd, out_w, err_w, status_w, tag_w)
    for fd in (stdin_fd, out_w, err_w, status_w, tag_w):
        os.close(fd)
    try:
        result = _supervise_run(limits, start, out_r, err_r, status_r, tag_r)
    finally:
        _kill_all(z, init)
        for fd in (out_r, err_r, status_r, tag_r):
            os.close(fd)
        _remove(workdir)
    result["wall_s"] = time.monotonic() - start
    return result


def _supervise_run(limits: dict[str, Any], start: float, out_r: int, err_r: int, status_r: int,
                   tag_r: int) -> dict[str, Any]:
    """Stream the program's output (never more than the limit in memory) until it exits, runs out
    of time or writes too much."""
    deadline = start + float(limits["timeout_s"])
    budget = int(limits["max_output_bytes"])
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    size, verdict, wait_status, tag = 0, None, None, b""
    open_fds = [out_r, err_r, status_r, tag_r]
    status_text = b""
    while verdict is None:
        left = deadline - time.monotonic()
        if left <= 0:
            verdict = "timeout"
            break
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if not data:
                open_fds.remove(fd)
                if fd == status_r and wait_status is None:
                    verdict = "killed"  # the init died without a word: killed from inside
                continue
            if fd == status_r:
                status_text += data
                if status_text.endswith(b"\n"):
                    wait_status = int(status_text)
            elif fd == tag_r:
                tag += data
            else:
                room = budget - size
                chunks[fd].append(data[:max(room, 0)])
                size += len(data)
                if size > budget:
                    verdict = "output_limit"
        if wait_status is not None and verdict is None:
            _drain(open_fds, chunks, out_r, err_r, budget, size)
            verdict = _verdict(wait_status, tag)
    code = None
    if wait_status is not None:
        code = os.waitstatus_to_exitcode(wait_status)
    return {"status": verdict, "returncode": code, "stdout": b"".join(chunks[out_r]).decode("utf-8", "replace"),
            "stderr": b"".join(chunks[err_r]).decode("utf-8", "replace")}


def _drain(open_fds, chunks, out_r: int, err_r: int, budget: int, size: int) -> None:
    """What the program wrote just before it exited (whatever is in the pipes now)."""
    for fd in (out_r, err_r):
        while fd in open_fds and select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            chunks[fd].append(data[:max(budget - size, 0)])
            size += len(data)


def _verdict(wait_status: int, tag: bytes) -> str:
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        return "timeout" if sig == signal.SIGXCPU else "killed"
    if b"M" in tag:
        return "memory"
    return "ok" if os.WEXITSTATUS(wait_status) == 0 else "error"


def _check(z, header: dict[str, Any]) -> dict[str, Any]:
    limits = {**z.limits, **header.get("limits", {})}
    count = int(header["count"])
    workdir = _workdir(z)
    import socket

    mine, theirs = socket.socketpair()
    start = time.monotonic()
    cpu_s = float(limits["timeout_s"]) * (count + 1)
    init = _fork_init(z, child.init_check, header["code"], workdir, theirs.fileno(), cpu_s)
    body = frames.read_frame(0)  # the tests: read only now, after the init (and so every program) forked
    report_r, report_w = os.pipe()
    judge_pid = _fork(z, judge.judge_main, body["tests"], body.get("setup", ""), mine.fileno(), report_w,
                      int(header.get("max_timeouts", 3)))
    mine.close()
    theirs.close()
    os.close(report_w)
    try:
        results = _collect(report_r, count, start + float(limits["timeout_s"]) * (count + 1) + 5.0)
    finally:
        _kill_all(z, init, judge_pid)
        os.close(report_r)
        _remove(workdir)
    return {"results": results, "wall_s": time.monotonic() - start}


def _collect(report_r: int, count: int, deadline: float) -> list[list[str]]:
    results: list[list[str]] = [["error", "not run: the judge stopped before this test (killed or out of time)"]
                                for _ in range(count)]
    reader = frames.FrameReader(report_r, 1 << 20)
    while True:
        try:
            message = reader.read(deadline)
        except (frames.Closed, frames.Timeout):
            return results
        if message.get("done"):
            return results
        i = message.get("i")
        if isinstance(i, int) and 0 <= i < count:
            results[i] = [str(message.get("status")), str(message.get("message", ""))]


# --- ending a request ------------------------------------------------------------------------------

def _kill_all(z, init: int, *others: int) -> None:
    """Kill everything the request started. With a PID namespace, killing its init is enough (the
    kernel kills the rest); otherwise every descendant of this process is found and killed, again
    until none is left (orphans come back here: the zygote is a child subreaper)."""
    for pid in (init, *others):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not z.active.get("pid_namespace"):
        _sweep()
    # The judge first (were it inside the namespace, a dying init would wait for its parent, this
    # process, to reap it).
    for pid in (*others, init):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def _sweep() -> None:
    me = os.getpid()
    for _ in range(200):
        found, todo = [], _children(me)
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += _children(pid)
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)  # stopped processes fork no more while we go round
            except (ProcessLookupError, PermissionError):
                pass
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(0.001)
