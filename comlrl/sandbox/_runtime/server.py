"""The zygote (Z): a pre-imported interpreter that forks every run and check.

Protocol on its stdin/stdout (length-prefixed JSON frames, :mod:`.frames`): the worker sends the
settings once and gets the isolation report; then per request a header frame
(``{"op": "run", "code", "stdin"}`` or ``{"op": "check", "code", "count", "max_timeouts",
"check_timeout_s"}``), for a check followed by ``{"tests", "setup", "exports"}``, which the zygote
reads only after forking the request's init, so the program's processes never hold the tests. The
answer is one frame.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import tempfile
import time
import traceback
from typing import Any

from . import child, cleanup, frames, judge, layers

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
    frames.write_frame(1, {"active": z.active, "reasons": z.reasons, "pid": os.getpid(),
                           "cgroups": z.cgroup.paths if z.cgroup is not None else []})
    status = 0
    try:
        while True:
            try:
                header = frames.read_frame(0)
            except frames.Closed:
                break
            handler = _run if header["op"] == "run" else _check
            layers.refresh(z)
            frames.write_frame(1, handler(z, header))
    except BaseException:  # a bug here: shown on the worker's stderr; the worker starts a new zygote
        traceback.print_exc()
        status = 70
    finally:
        if z.cgroup is not None:
            z.cgroup.remove()
        os._exit(status)


# --- one request -----------------------------------------------------------------------------------

def _workdir(z) -> str:
    """A fresh working directory for one request: a tmpfs of its own with the mount namespace."""
    path = tempfile.mkdtemp(prefix="run-", dir=z.base_dir)
    try:
        if z.active.get("mount_namespace"):
            layers.mount_workdir(z, path)
        elif z.uids is not None:
            os.chown(path, z.uids[0], z.uids[0])
    except BaseException:
        _remove(z, path)
        raise
    return path


def _remove(z, path: str) -> None:
    """Remove a request's working directory and all the program left in it (never raises)."""
    if z.active.get("mount_namespace") and layers.unmount_workdir(path):
        try:
            os.rmdir(path)
            return
        except OSError:
            pass
    cleanup.remove_tree(path)


def _entry(z, target, *args) -> None:
    """The start of a forked request process; a bug in trusted code is shown on the worker's stderr."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        target(z, *args)
    except BaseException:
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
    parent_fds: list[int] = []   # ours: closed at the end
    child_fds: list[int] = []    # the init's ends: closed once it has them
    init = None
    try:
        stdin_fd = os.memfd_create("stdin")
        child_fds.append(stdin_fd)
        frames.write_all(stdin_fd, header.get("stdin", "").encode())
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        for _ in range(4):  # stdout, stderr, status, tag
            r, w = os.pipe()
            parent_fds.append(r)
            child_fds.append(w)
        out_r, err_r, status_r, tag_r = parent_fds
        oom_before = z.cgroup.oom_kills() if z.cgroup is not None else 0
        start = time.monotonic()
        init = _fork_init(z, child.init_run, header["code"], workdir, *child_fds)
        _close(child_fds)
        result = _supervise_run(limits, start, out_r, err_r, status_r, tag_r)
        if z.cgroup is not None and result["status"] == "killed" and z.cgroup.oom_kills() > oom_before:
            result["status"] = "memory"  # killed by the kernel: the run's cgroup was out of memory
    finally:
        if init is not None:
            _kill_all(z, init)
        elif z.cgroup is not None:
            z.cgroup.kill()
        _close(child_fds + parent_fds)
        _remove(z, workdir)
    result["wall_s"] = time.monotonic() - start
    return result


def _close(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


_DRAIN_S = 1.0  # after the program's exit, how long its output is still read


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
                tag += data[:16]
            else:
                size = _keep(chunks[fd], data, budget, size)
                if size > budget:
                    verdict = "output_limit"
        if wait_status is not None and verdict is None:
            size = _drain(open_fds, chunks, (out_r, err_r), budget, size, time.monotonic() + _DRAIN_S)
            verdict = "output_limit" if size > budget else _verdict(wait_status, tag)
    code = None
    if wait_status is not None:
        code = os.waitstatus_to_exitcode(wait_status)
    return {"status": verdict, "returncode": code, "stdout": b"".join(chunks[out_r]).decode("utf-8", "replace"),
            "stderr": b"".join(chunks[err_r]).decode("utf-8", "replace")}


def _keep(chunks: list[bytes], data: bytes, budget: int, size: int) -> int:
    chunks.append(data[:max(budget - size, 0)])
    return size + len(data)


def _drain(open_fds, chunks, fds: tuple[int, int], budget: int, size: int, deadline: float) -> int:
    """What the program wrote just before it exited (whatever is in the pipes now): until the
    pipes are empty, the budget is passed, or the deadline (a process it left behind may still
    hold them and write on). The new size."""
    for fd in fds:
        while fd in open_fds and size <= budget and time.monotonic() < deadline \
                and select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            size = _keep(chunks[fd], data, budget, size)
    return size


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
    timeout_s = float(limits["timeout_s"])
    check_s = float(header.get("check_timeout_s") or timeout_s * (count + 1))
    workdir = _workdir(z)
    mine = theirs = None
    report_r = report_w = None
    init = judge_pid = None
    start = time.monotonic()
    try:
        mine, theirs = socket.socketpair()
        init = _fork_init(z, child.init_check, header["code"], workdir, theirs.fileno(), check_s + timeout_s)
        body = frames.read_frame(0)  # the tests: read only now, after the init (and so every program) forked
        report_r, report_w = os.pipe()
        judge_pid = _fork(z, judge.judge_main, body["tests"], body.get("setup", ""), body.get("exports"),
                          mine.fileno(), report_w, int(header.get("max_timeouts", 3)), check_s)
        mine.close()
        theirs.close()
        os.close(report_w)
        report_w = None
        results = _collect(report_r, count, start + check_s + 5.0)
    finally:
        for sock in (mine, theirs):
            if sock is not None:
                sock.close()
        _close([fd for fd in (report_r, report_w) if fd is not None])
        if init is not None:
            _kill_all(z, init, *([judge_pid] if judge_pid is not None else []))
        elif z.cgroup is not None:
            z.cgroup.kill()
        _remove(z, workdir)
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
    if z.cgroup is not None:
        z.cgroup.kill()
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
