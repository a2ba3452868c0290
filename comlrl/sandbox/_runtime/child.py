"""The untrusted program (U), as the request's handler forks it.

The handler holds its own request's header and nothing of any other request, and a check's tests
never (its judge reads them), so no program ever holds another request's bytes or its own
tests. ``run``: the handler forks the program once; it runs the code as ``python program.py``
would (its non-daemon threads waited for, then its atexit handlers, all within the run's time).
``check``: the handler forks a program whenever the judge asks (:func:`spawn`) and hands the
judge its ends of two fresh pipes; the program loads the code, then serves calls to its
functions. Each program process joins the run's cgroup and Landlock's read rules first, then is
restricted (:func:`.layers.restrict`).
"""

from __future__ import annotations

import atexit
import builtins
import gc
import linecache
import os
import random
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from . import codec, frames, layers

__all__ = ["program_run", "spawn", "kill_group", "as_forked", "describe", "clean_text"]

_LOADED_NAME = "solution"  # __name__ of checked code: `if __name__ == "__main__":` blocks do not run
_FILENAME = "<program>"    # the program's file name in tracebacks


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

def program_run(z, code: str, workdir: str, stdin_fd: int, out_w: int, err_w: int, tag_w: int) -> None:
    """U of a run: in the run's cgroup and read rules (through descriptors that the next steps
    close), its input, output and memory-tag pipe in place, the code run as a program."""
    layers.enter_program(z)
    _move_fds({stdin_fd: 0, out_w: 1, err_w: 2, tag_w: 4})
    _close_other_fds({4})
    try:
        _program_run(z, code, workdir)
    except BaseException:  # setting up the program failed (a sandbox bug): say why on its stderr
        traceback.print_exc()
        _flush()
    finally:
        os._exit(70)


def _program_run(z, code: str, workdir: str) -> None:
    layers.restrict(z, "program", workdir, z.limits["timeout_s"], z.limits["memory_mb"])
    random.seed(0)
    sys.argv = ["program"]
    sys.stdin = open(0, "r", closefd=False)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    status = 0
    try:
        exec(_compile(code), namespace)
    except SystemExit as exc:
        status = _exit_code(exc.code)
    except MemoryError:
        os.write(4, b"M")
        _print_exception()
        status = 1
    except BaseException:  # the program's own error: its traceback, as python would print it
        _print_exception()
        status = 1
    os._exit(_finalize(status))


def _compile(code: str):
    """The program's code object; its lines registered for tracebacks (as a file's would be)."""
    atexit._clear()  # handlers of the zygote's modules are not the program's
    linecache.cache[_FILENAME] = (len(code), None, code.splitlines(True), _FILENAME)
    return compile(code, _FILENAME, "exec")


def _finalize(status: int) -> int:
    """What the interpreter does when a program ends: wait for its non-daemon threads, run its
    atexit handlers (a SystemExit there sets the status), flush. The exit status."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        _print_exception()
    try:
        atexit._run_exitfuncs()  # prints the handlers' own errors, as the interpreter does
    except SystemExit as exc:
        status = _exit_code(exc.code)
    except BaseException:
        pass
    _flush()
    return status


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
    """The exception being handled, as python prints it for a program: from the program's first
    frame on (the sandbox's own frames, and the paths they would show, are left out)."""
    try:
        kind, exc, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename != _FILENAME:
            tb = tb.tb_next
        traceback.print_exception(kind, exc, tb)
    except BaseException:
        pass
    _flush()


# --- check ----------------------------------------------------------------------------------------

def as_forked() -> None:
    """In a process just forked by a handler: undo what the handler set for itself (its SIGCHLD
    wake-ups, its collector turned off), so that a program runs as Python would run it."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    gc.enable()


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(z, code: str, workdir: str, sock: socket.socket, gen: int, cpu_s: float) -> int:
    """A program process for the judge's ``spawn <gen>``: fork it, send the judge its pipe ends
    (requests in, replies out) on ``sock``; its pid."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            as_forked()
            layers.enter_program(z)
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
        exec(_compile(code), namespace)
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
