"""The init of a request (T) and the untrusted program (U).

T is forked before the judge's tests are read, so neither it nor any program it forks ever holds
them. ``run``: T forks the program once, reports its wait status and exits (in a PID namespace its
exit kills everything the program left). ``check``: T forks a program whenever the judge asks
(``spawn``) and hands the judge its ends of two fresh pipes; the program loads the code, then
serves calls to its functions.
"""

from __future__ import annotations

import builtins
import os
import random
import select
import signal
import socket
import sys
import traceback
from typing import Any

from . import codec, frames, layers, osapi

__all__ = ["init_run", "init_check", "describe", "clean_text"]

_LOADED_NAME = "solution"  # __name__ of checked code: `if __name__ == "__main__":` blocks do not run


def _close_other_fds(keep: set[int]) -> None:
    top = 3
    for fd in sorted(keep):
        if fd >= top:
            os.closerange(top, fd)
        top = max(top, fd + 1)
    os.closerange(top, os.sysconf("SC_OPEN_MAX"))


def _move_fds(fds: dict[int, int]) -> None:
    """dup2 ``{source: target}`` without clobbering a source that is another's target."""
    safe = {src: os.dup(src) for src in fds}
    for src, dst in fds.items():
        os.dup2(safe[src], dst)
    for fd in safe.values():
        if fd not in fds.values():
            os.close(fd)


def _reap(block: bool = False) -> list[tuple[int, int]]:
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))
        block = False


def clean_text(text: str) -> str:
    """``text`` as valid UTF-8: a program's lone surrogates (``chr(0xD800)``) become "?" (they would
    crash a tokenizer once its error message is part of the next prompt)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def describe(exc: BaseException) -> str:
    """``Type: message``, one line, for reports."""
    try:
        name, message = type(exc).__name__, str(exc)
    except Exception:  # a program's exception whose __str__ raises
        name, message = type(exc).__name__, "<unprintable>"
    text = f"{name}: {message}" if message else name
    return clean_text(" ".join(text.split())[:500])


# --- run ------------------------------------------------------------------------------------------

def _end_with_zygote(z) -> None:
    """Die with the zygote (and so end the request's PID namespace). Not possible where the init
    was forked by a short-lived helper (its death would fire the signal at once): there the init's
    own deadline and the judge's hang-up end the request."""
    if not z.pid_helper:
        osapi.prctl(osapi.PR_SET_PDEATHSIG, signal.SIGKILL)


def _deadline(program: int, seconds: float) -> None:
    """Kill the program and exit after ``seconds``, whatever the zygote does (a backstop)."""
    def expire(signum, frame):
        _kill_group(program)
        os._exit(0)
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds + 0.999)))


def init_run(z, code: str, workdir: str, stdin_fd: int, out_w: int, err_w: int, status_w: int, tag_w: int) -> None:
    """T of a run: fork the program, report its wait status on ``status_w``, exit."""
    layers.enter_request(z)
    _move_fds({stdin_fd: 0, out_w: 1, err_w: 2, status_w: 3, tag_w: 4})
    _close_other_fds({3, 4})
    _end_with_zygote(z)
    pid = os.fork()
    if pid == 0:
        os.close(3)
        try:
            _program_run(z, code, workdir)
        except BaseException:  # setting up the program failed (a sandbox bug): say why on its stderr
            _print_exception()
        finally:
            os._exit(70)
    os.close(4)
    for fd in (0, 1, 2):
        os.close(fd)
    _deadline(pid, float(z.limits["timeout_s"]) + 5)
    while True:
        for child, status in _reap(block=True) or [(None, None)]:
            if child == pid:
                frames.write_all(3, f"{status}\n".encode())
                os._exit(0)
            if child is None:
                os._exit(0)


def _program_run(z, code: str, workdir: str) -> None:
    layers.restrict(z, "program", workdir, z.limits["timeout_s"], z.limits["memory_mb"])
    random.seed(0)
    sys.argv = ["program"]
    sys.stdin = open(0, "r", closefd=False)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<program>", "exec"), namespace)
    except SystemExit as exc:
        _flush()
        os._exit(_exit_code(exc.code))
    except MemoryError:
        os.write(4, b"M")
        _print_exception()
        os._exit(1)
    except BaseException:  # the program's own error: its traceback, as python would print it
        _print_exception()
        os._exit(1)
    _flush()
    os._exit(0)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _print_exception() -> None:
    try:
        traceback.print_exc()
    except BaseException:
        pass
    _flush()


# --- check ----------------------------------------------------------------------------------------

def init_check(z, code: str, workdir: str, control: int, cpu_s: float) -> None:
    """T of a check: on each ``spawn <gen>`` from the judge (a socket), kill the previous program,
    fork a new one and send the judge its pipe ends; reap orphans; exit when the judge hangs up."""
    layers.enter_request(z)
    null = os.open(os.devnull, os.O_RDWR)
    _move_fds({null: 0, control: 3})
    os.dup2(0, 1)
    os.dup2(0, 2)
    _close_other_fds({3})
    _end_with_zygote(z)
    sock = socket.socket(fileno=3)
    current = None
    pending = b""
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        _reap()
        if not ready:
            continue
        data = sock.recv(4096)
        if not data:
            if current is not None:
                _kill_group(current)
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            gen = int(line.split()[1])
            if current is not None:
                _kill_group(current)
            current = _spawn(z, code, workdir, sock, gen, cpu_s)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(z, code: str, workdir: str, sock: socket.socket, gen: int, cpu_s: float) -> int:
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _move_fds({req_r: 3, resp_w: 4})
            _close_other_fds({3, 4})
            _program_serve(z, code, workdir, gen, cpu_s)
        except BaseException as exc:  # setting up the program failed (a sandbox bug): the judge reports it
            frames.write_line(4, {"gen": gen, "load_error": f"sandbox: {describe(exc)}"})
        finally:
            os._exit(70)
    os.close(req_r)
    os.close(resp_w)
    socket.send_fds(sock, [b"p"], [req_w, resp_r])
    os.close(req_w)
    os.close(resp_r)
    return pid


def _program_serve(z, code: str, workdir: str, gen: int, cpu_s: float) -> None:
    layers.restrict(z, "program", workdir, cpu_s, z.limits["memory_mb"])
    random.seed(0)
    sys.argv = ["program"]
    namespace: dict[str, Any] = {"__name__": _LOADED_NAME, "__builtins__": builtins}
    try:
        exec(compile(code, "<program>", "exec"), namespace)
        hello = {"gen": gen, "names": _exported(namespace)}
    except BaseException as exc:  # SystemExit too: a program that exits while loading has no functions
        hello = {"gen": gen, "load_error": describe(exc)}
    frames.write_all(4, b"\n")  # ends any half line a previous program left (not possible with fresh pipes, cheap)
    frames.write_line(4, hello)
    if "load_error" in hello:
        os._exit(1)
    reader = frames.LineReader(3, int(z.limits["max_output_bytes"]))
    while True:
        try:
            request = reader.read(None)
        except frames.Closed:
            os._exit(0)
        if isinstance(request, dict) and request.get("gen") == gen:
            frames.write_line(4, _answer(namespace, request))


def _exported(namespace: dict[str, Any]) -> dict[str, Any]:
    """Top-level names the tests may use: functions (called over the pipe) and plain values."""
    functions, values = [], {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if callable(value) and not isinstance(value, type):
            functions.append(name)
            continue
        try:
            values[name] = codec.encode(value)
        except (codec.Unsupported, RecursionError):
            pass
    return {"functions": functions, "values": values}


def _answer(namespace: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = {"gen": request["gen"], "id": request.get("id")}
    try:
        func = namespace[request["name"]]
        args = codec.decode(request["args"])
        kwargs = codec.decode(request["kwargs"])
        value = func(*args, **kwargs)
    except BaseException as exc:  # the program's error (SystemExit included) is the call's result
        reply["error"] = [type(exc).__name__, describe(exc)]
        return reply
    try:
        reply["value"] = codec.encode(value)
    except (codec.Unsupported, RecursionError) as exc:
        reply["error"] = ["TypeError", f"the function returned {exc}; tests compare only built-in values "
                                       "(int, float, str, bool, None, list, tuple, dict, set, bytes)"]
    return reply
