"""The zygote (Z) and the request handlers (H) it forks ahead.

Protocol on the worker's pipe (length-prefixed JSON frames, :mod:`.frames`): the worker sends the
settings once and gets the isolation report; then per request a header frame
(``{"op": "run", "code", "stdin"}`` or ``{"op": "check", "code", "count", "max_timeouts",
"check_timeout_s"}``), for a check followed by ``{"tests", "setup", "exports"}``. The answer is
one frame.

The zygote never reads a request or an answer. Each request is read, served and answered by a
handler forked from it before the request arrived, which exits afterwards; the handler is the
first process (PID 1) of the request's own PID namespace, and forks the request's program
processes itself. So every program is forked from a process that holds its own request's header
(its code and input) and nothing of any other request: no earlier tests, code, input or output
to find in its memory. A check's tests are read by its judge alone (forked by the handler, and
forking nothing), and its results reach the handler only once the judge is done, when no
program is forked any more. Handlers take turns by a token (:func:`_serve`): neither a fork nor
the zygote is on a request's path.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import time
import traceback
from typing import Any, Optional

from . import child, cleanup, frames, judge, layers, osapi

__all__ = ["main"]

# Imported once here so that a forked program need not import them again.
_PREIMPORT = ("math", "re", "itertools", "functools", "collections", "heapq", "bisect", "string", "random",
              "statistics", "fractions", "decimal", "typing", "copy", "operator", "datetime", "json", "hashlib",
              "array", "dataclasses", "enum", "textwrap", "unicodedata", "cmath", "traceback")
_CLOSED = 3  # a handler's exit status when the worker closed the pipe (the zygote stops)
_SPARES = 2  # handlers alive: one serving, one holding the token (waiting for the next request)


def main() -> None:
    config = frames.read_frame(0)
    z = layers.setup(config)
    for name in _PREIMPORT:
        importlib.import_module(name)
    gc.freeze()  # forked children then touch (copy) fewer of the zygote's pages
    frames.write_frame(1, {"active": z.active, "reasons": z.reasons, "pid": os.getpid(),
                           "cgroups": z.cgroup.paths if z.cgroup is not None else []})
    status = 70
    try:
        status = _serve(z)
    except BaseException:  # a bug here: shown on the worker's stderr; the worker starts a new zygote
        traceback.print_exc()
    finally:
        _sweep()  # whatever a failed handler left
        if z.cgroup is not None:
            z.cgroup.remove()
        os._exit(status)


def _serve(z) -> int:
    """Keep handlers forked ahead, each serving one request; the exit status. They take turns by
    a token (one byte in a pipe): the holder reads its request whole, hands the token on (the
    next handler then waits for the next request while this one serves) and exits after its
    answer; a new handler replaces it."""
    token = os.pipe()
    os.write(token[1], b"t")
    life = os.pipe()  # never written: its reading end tells a handler that the zygote is gone
    handlers = {_fork_handler(z, token, life) for _ in range(_SPARES)}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 70
        if pid not in handlers:
            continue  # an orphan come back here (a handler died), or a PID-namespace helper
        handlers.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:  # the worker closed the pipe, or a bug (shown on the worker's stderr)
            for other in handlers:
                _signal(other, signal.SIGKILL)
            return 0 if code == _CLOSED else 70
        handlers.add(_fork_handler(z, token, life))


def _fork_handler(z, token: tuple[int, int], life: tuple[int, int]) -> int:
    """A handler, PID 1 of a new PID namespace where that layer is on. Released by its gate once
    it is the zygote's child (a PID-namespace helper that forked it has exited)."""
    gate = os.pipe()
    pid = layers.fork_in_new_pid_namespace(z, lambda: _entry(z, _handle, token, life, gate))
    os.close(gate[0])
    os.write(gate[1], b"g")
    os.close(gate[1])
    return pid


def _handle(z, token: tuple[int, int], life: tuple[int, int], gate: tuple[int, int]) -> None:
    """H: set up what needs no request (its namespaces: while a spare), take the token, read one
    request, pass the token on, serve the request, answer, exit."""
    os.close(gate[1])
    os.close(life[1])
    os.read(gate[0], 1)
    os.close(gate[0])
    osapi.prctl(osapi.PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the zygote (and so does its namespace)
    if select.select([life[0]], [], [], 0)[0]:
        os._exit(_CLOSED)  # the zygote died before that was set
    osapi.prctl(osapi.PR_SET_CHILD_SUBREAPER, 1)         # orphans of the request come back here
    gc.disable()  # short-lived: no collection to copy the zygote's pages for
    layers.enter_request(z)
    children = _Children()
    if not os.read(token[0], 1):
        os._exit(_CLOSED)
    try:
        header = frames.read_frame(0)
    except frames.Closed:
        os._exit(_CLOSED)
    # Made only now: a working directory made ahead would exist while the previous request runs
    # (under the same uid), for it to leave files in.
    workdir = _workdir(z)
    layers.refresh(z)
    if header["op"] == "run":
        _pass(token)
        answer = _run(z, header, workdir, children)
    else:
        answer = _check(z, header, token, workdir, children)
    frames.write_frame(1, answer)
    os._exit(0)


def _pass(token: tuple[int, int]) -> None:
    """Hand the token on (the request is read whole: the next handler may read the next one)."""
    os.write(token[1], b"t")
    _close(list(token))


class _Children:
    """Exits of this process's children, for select(): SIGCHLD wakes a pipe, reap() collects."""

    def __init__(self):
        self.fd, write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(write, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(write)
        self.status: dict[int, int] = {}

    def reap(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        self.status.update(_reap())


# --- one request -----------------------------------------------------------------------------------

def _workdir(z) -> str:
    """A fresh working directory for one request: a tmpfs of its own with the mount namespace
    (mounted in the handler's own mount namespace where it has one: it goes with the request)."""
    path = os.path.join(z.runs_dir, "run-" + os.urandom(6).hex())
    os.mkdir(path, 0o700)
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
    """The start of a forked process; a bug in trusted code is shown on the worker's stderr."""
    try:
        child.as_forked()
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


def _run(z, header: dict[str, Any], workdir: str, children: _Children) -> dict[str, Any]:
    limits = {**z.limits, **header.get("limits", {})}
    parent_fds: list[int] = []   # ours: closed at the end
    child_fds: list[int] = []    # the program's ends: closed once it has them
    program = None
    try:
        stdin_fd = os.memfd_create("stdin")
        child_fds.append(stdin_fd)
        frames.write_all(stdin_fd, header.get("stdin", "").encode())
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        for _ in range(3):  # stdout, stderr, tag
            r, w = os.pipe()
            parent_fds.append(r)
            child_fds.append(w)
        out_r, err_r, tag_r = parent_fds
        oom_before = z.cgroup.oom_kills() if z.cgroup is not None else 0
        start = time.monotonic()
        program = _fork(z, child.program_run, header["code"], workdir, *child_fds)
        _close(child_fds)
        result = _supervise_run(limits, start, out_r, err_r, tag_r, program, children)
        if z.cgroup is not None and result["status"] == "killed" and z.cgroup.oom_kills() > oom_before:
            result["status"] = "memory"  # killed by the kernel: the run's cgroup was out of memory
    finally:
        _kill_all(z, *([program] if program is not None else []))
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


def _supervise_run(limits: dict[str, Any], start: float, out_r: int, err_r: int, tag_r: int, program: int,
                   children: _Children) -> dict[str, Any]:
    """Stream the program's output (never more than the limit in memory) until it exits, runs out
    of time or writes too much."""
    deadline = start + float(limits["timeout_s"])
    budget = int(limits["max_output_bytes"])
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    size, verdict, tag = 0, None, b""
    open_fds = [out_r, err_r, tag_r, children.fd]
    while verdict is None:
        left = deadline - time.monotonic()
        if left <= 0:
            verdict = "timeout"
            break
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            if fd == children.fd:
                children.reap()
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                open_fds.remove(fd)
            elif fd == tag_r:
                tag += data[:16]
            else:
                size = _keep(chunks[fd], data, budget, size)
                if size > budget:
                    verdict = "output_limit"
        if program in children.status and verdict is None:
            size = _drain(open_fds, chunks, (out_r, err_r), budget, size, time.monotonic() + _DRAIN_S)
            verdict = "output_limit" if size > budget else _verdict(children.status[program], tag)
    code = None
    if program in children.status:
        code = os.waitstatus_to_exitcode(children.status[program])
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


def _check(z, header: dict[str, Any], token: tuple[int, int], workdir: str, children: _Children) -> dict[str, Any]:
    limits = {**z.limits, **header.get("limits", {})}
    count = int(header["count"])
    timeout_s = float(limits["timeout_s"])
    check_s = float(header.get("check_timeout_s") or timeout_s * (count + 1))
    start = time.monotonic()
    judge_end, spawns = socket.socketpair()
    report_r, report_w = os.pipe()
    judge_pid = None
    try:
        # The judge reads the tests itself and hands the token on: this process never holds them.
        judge_pid = _fork(z, judge.judge_request, token, judge_end.fileno(), report_w,
                          int(header.get("max_timeouts", 3)), check_s)
        os.close(report_w)
        judge_end.close()
        _close(list(token))
        results = _serve_check(z, header["code"], workdir, spawns, report_r, count, check_s + timeout_s,
                               start + check_s + 5.0, children)
    finally:
        os.close(report_r)
        spawns.close()
        _kill_all(z, *([judge_pid] if judge_pid is not None else []))
        _remove(z, workdir)
    return {"results": results, "wall_s": time.monotonic() - start}


def _serve_check(z, code: str, workdir: str, spawns: socket.socket, report_r: int, count: int, cpu_s: float,
                 deadline: float, children: _Children) -> list[list[str]]:
    """Fork a program whenever the judge asks (``spawn <gen>``: the previous one is killed) and
    send the judge its pipe ends; reap what exits; once the judge reports, collect its results
    (all at its end: from then on no program is forked)."""
    results: list[list[str]] = [["error", "not run: the judge stopped before this test (killed or out of time)"]
                                for _ in range(count)]
    current: Optional[int] = None
    pending, waiting = b"", [spawns, report_r, children.fd]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return results
        ready, _, _ = select.select(waiting, [], [], left)
        if children.fd in ready:
            children.reap()
        if report_r in ready:
            return _collect(report_r, results, deadline)
        if spawns in ready:
            data = spawns.recv(4096)
            if not data:
                waiting.remove(spawns)  # the judge is gone: its report pipe says the rest
                continue
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if current is not None:
                    child.kill_group(current)
                current = child.spawn(z, code, workdir, spawns, int(line.split()[1]), cpu_s)


def _collect(report_r: int, results: list[list[str]], deadline: float) -> list[list[str]]:
    reader = frames.FrameReader(report_r, 1 << 20)
    while True:
        try:
            message = reader.read(deadline)
        except (frames.Closed, frames.Timeout):
            return results
        if message.get("done"):
            return results
        i = message.get("i")
        if isinstance(i, int) and 0 <= i < len(results):
            results[i] = [str(message.get("status")), str(message.get("message", ""))]


# --- ending a request ------------------------------------------------------------------------------

def _kill_all(z, *pids: int) -> None:
    """Kill everything the request started. As the init of the request's PID namespace: every
    other process in it at once (kill(-1) there is atomic with respect to fork), then reap them
    all. Otherwise every descendant of this process is found and killed, again until none is left
    (orphans come back here: the handler is a child subreaper)."""
    init = z.active.get("pid_namespace") and os.getpid() == 1
    if init:
        _signal(-1, signal.SIGKILL)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    if z.cgroup is not None:
        z.cgroup.kill()
    if not init:
        _sweep()
    _reap(block=True)


def _reap(block: bool = False) -> dict[int, int]:
    """Reap exited children (with ``block``, all of them, waiting for each); ``{pid: status}``."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


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


def _descendants() -> list[int]:
    me = os.getpid()
    found, todo = [], _children(me)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += _children(pid)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep() -> None:
    """Kill every descendant of this process (a child subreaper: orphans of a request come back
    here) until none is left, however fast they fork. Each pass stops every process it finds (a
    stopped process forks no more: a fork under way when SIGSTOP arrives is undone; stopping all
    again each pass undoes a SIGCONT between them), until a pass finds none it had not found
    before; then the whole tree, known and stopped, is killed. No round limit: whatever escapes
    one pass is found by the next."""
    killed: set[int] = set()
    while True:
        seen: set[int] = set()
        while True:
            tree = _descendants()
            for pid in tree:
                _signal(pid, signal.SIGSTOP)
            if seen.issuperset(tree):
                break
            seen.update(tree)
        if not tree:
            return
        for pid in tree:
            _signal(pid, signal.SIGKILL)
        _reap()
        if killed.issuperset(tree):
            time.sleep(0.001)  # killed already and not yet reaped (still exiting): let them go
        killed.update(tree)
