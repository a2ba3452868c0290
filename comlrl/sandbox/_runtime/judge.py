"""The judge (J): runs each test in its own process, calling the program's functions over a pipe.

Trust comes from the process boundary. The program's code never runs here: a test's
``assert candidate(x) == y`` is evaluated by the judge with its own builtins and modules, on a
value rebuilt from plain data (:mod:`.codec`). So a program that exits, kills processes, prints
fake results, patches builtins or returns an object with a rigged ``__eq__`` can fail tests but not
pass them. A test passes only when the judge saw it run to the end; the result goes to the handler
on a pipe the program never holds.
"""

from __future__ import annotations

import builtins
import itertools
import os
import random
import signal
import socket
import time
import traceback
from typing import Any, Optional

from . import codec, frames, layers
from .child import _close_other_fds, _move_fds, clean_text, describe

__all__ = ["judge_request", "judge_main"]

# Names a program may not shadow in the tests' namespace (nor any dunder name, e.g. __builtins__).
_RESERVED = set(dir(builtins)) | {"candidate", "__builtins__"}
# Exceptions a call may not raise into a test as themselves: a StopIteration from the program
# would end the test's generator or loop early, and a test of all(...) over it would pass (PEP 479).
_AS_RUNTIME_ERROR = (StopIteration, StopAsyncIteration)


class _TestTimeout(BaseException):
    """The test ran out of time (a BaseException, so a test's ``except Exception`` cannot swallow it)."""


class _ProgramGone(Exception):
    """The program exited or was killed during a call."""


class _Program:
    """The current program process: spawned through the init, called over two pipes."""

    def __init__(self, control: socket.socket, limit: int):
        self.control, self.limit = control, limit
        self.gen, self.ids = 0, itertools.count()
        self.req_w: Optional[int] = None
        self.reader: Optional[frames.LineReader] = None
        self.deadline: Optional[float] = None
        self.last_call = ""

    def spawn(self, deadline: float) -> dict[str, Any]:
        """A fresh program; its hello message (names, or the load error)."""
        self.close()
        self.gen += 1
        self.control.sendall(f"spawn {self.gen}\n".encode())
        _, fds, _, _ = socket.recv_fds(self.control, 16, 2)
        if len(fds) != 2:  # the init is gone (killed by the program, or out of time)
            raise frames.Closed("the request's init did not answer")
        self.req_w, resp_r = fds
        self.reader = frames.LineReader(resp_r, self.limit)
        while True:
            hello = self.reader.read(deadline)
            if isinstance(hello, dict) and hello.get("gen") == self.gen:
                return hello

    def close(self) -> None:
        if self.req_w is not None:
            os.close(self.req_w)
            os.close(self.reader.fd)
            self.req_w = self.reader = None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        try:
            payload = {"args": codec.encode(list(args)), "kwargs": codec.encode(kwargs)}
        except (codec.Unsupported, RecursionError) as exc:
            raise TypeError(f"a test passed {exc} to {name}(); only built-in values cross to the program") from None
        if self.req_w is None:
            raise _ProgramGone("the program is not running")
        call_id = next(self.ids)
        self.last_call = f"{name}({_short_args(args, kwargs)})"
        try:
            frames.write_line(self.req_w, {"gen": self.gen, "id": call_id, "name": name, **payload})
            while True:
                reply = self.reader.read(self.deadline)
                if isinstance(reply, dict) and reply.get("gen") == self.gen and reply.get("id") == call_id:
                    break
        except frames.Timeout:
            raise _TestTimeout() from None
        except (frames.Closed, BrokenPipeError):
            self.close()
            raise _ProgramGone(f"the program exited or was killed during {self.last_call}") from None
        if "error" in reply:
            raise _program_error(reply["error"], self.last_call)
        value = codec.decode(reply.get("value"))
        self.last_call += f" returned {_short(value)}"
        return value


def _short(value: Any, size: int = 120) -> str:
    try:
        text = repr(value)
    except Exception:  # e.g. an int past Python's digit limit for str()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= size else text[:size] + "..."


def _short_args(args: tuple, kwargs: dict) -> str:
    parts = [_short(a, 60) for a in args] + [f"{k}={_short(v, 60)}" for k, v in kwargs.items()]
    return _short(", ".join(parts), 160).strip("'")


def _program_error(error: Any, call: str) -> Exception:
    """The program's exception as one of the same built-in type (so a test expecting ValueError
    sees one), else a RuntimeError; the message says which call raised it."""
    name, text = (error + ["", ""])[:2] if isinstance(error, list) else ("Error", str(error))
    kind = getattr(builtins, str(name), None)
    message = f"{call} raised {text}"
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _AS_RUNTIME_ERROR):
        try:
            return kind(message)
        except Exception:
            pass
    return RuntimeError(message)


def _stub(program: _Program, name: str):
    def call(*args, **kwargs):
        return program.call(name, args, kwargs)
    call.__name__ = call.__qualname__ = name
    return call


def _namespace(program: _Program, hello: dict[str, Any], exports: Optional[list[str]]) -> dict[str, Any]:
    """The program's names the tests see: those it reported (or only ``exports`` of them, when
    given), functions as stubs, values rebuilt from data."""
    names = hello.get("names") or {}
    allowed = set(exports) if exports is not None else None

    def usable(name: Any) -> bool:
        return (isinstance(name, str) and name.isidentifier() and name not in _RESERVED and not name.startswith("__")
                and (allowed is None or name in allowed))
    out: dict[str, Any] = {}
    values = names.get("values")
    for name, data in (values.items() if isinstance(values, dict) else ()):
        if usable(name):
            try:
                out[name] = codec.decode(data)
            except (ValueError, TypeError, RecursionError):  # a value it forged: left out
                pass
    functions = names.get("functions")
    for name in (functions if isinstance(functions, list) else ()):
        if usable(name):
            out[name] = _stub(program, name)
    return out


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _failure_message(exc: BaseException, source: str, program: _Program) -> str:
    line = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == "<test>" and frame.lineno:
            lines = source.splitlines()
            line = lines[frame.lineno - 1].strip() if frame.lineno <= len(lines) else ""
            break
    text = describe(exc)
    if isinstance(exc, AssertionError):
        text = "AssertionError" + (f": {exc}" if str(exc) else "")
        if program.last_call and " returned " in program.last_call:
            text += f" ({program.last_call})"
    return f"{line}: {text}" if line else text


def _run_one(program: _Program, base: dict[str, Any], setup: str, test: str, timeout_s: float) -> tuple[str, str]:
    """One test. ``setup`` (trusted) runs first, after the program's names are in place, so what it
    defines (e.g. a task's own helper functions) replaces anything of the program's of that name."""
    program.deadline = time.monotonic() + timeout_s
    program.last_call = ""
    namespace = {"__name__": "__test__", "__builtins__": builtins, **base}
    random.seed(0)  # tests that draw random inputs draw the same ones every time
    signal.setitimer(signal.ITIMER_REAL, timeout_s + 0.5)
    try:
        if setup:
            exec(compile(setup, "<setup>", "exec"), namespace)
        exec(compile(test, "<test>", "exec"), namespace)
        return "passed", ""
    except _TestTimeout:
        return "timeout", f"no result within {timeout_s:g} s" + (f" (during {program.last_call})"
                                                                if program.last_call else "")
    except AssertionError as exc:
        return "failed", _failure_message(exc, test, program)
    except BaseException as exc:  # the program's error, a crash, or a broken test
        return "error", _failure_message(exc, test, program)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def judge_request(z, token: tuple[int, int], control: int, report: int, max_timeouts: int, check_s: float) -> None:
    """J as the handler forks it: read the check's tests from the worker's pipe (the handler,
    which forks the programs, never holds them), hand the handler's token on, judge."""
    body = frames.read_frame(0)
    os.write(token[1], b"t")
    judge_main(z, body["tests"], body.get("setup", ""), body.get("exports"), control, report, max_timeouts, check_s)


def judge_main(z, tests: list[str], setup: str, exports: Optional[list[str]], control: int, report: int,
               max_timeouts: int, check_s: float) -> None:
    """J: spawn the program, run every test, then report each result (``{"i", "status",
    "message"}``) on ``report`` and ``{"done": true}``: all at the end, when no program will be
    forked any more (results quote the tests; the handler that forks the programs must not hold
    them before). Loading and all tests together get ``check_s`` seconds: a test has
    ``timeout_s`` or what is left of them."""
    start = time.monotonic()
    layers.confine_reads(z)
    null = os.open(os.devnull, os.O_RDWR)
    _move_fds({null: 0, control: 3, report: 4})
    os.dup2(0, 1)
    os.dup2(0, 2)
    _close_other_fds({3, 4})
    control, report = 3, 4
    timeout_s = float(z.limits["timeout_s"])
    layers.restrict(z, "judge", None, check_s + 2 * timeout_s, max(z.limits["memory_mb"], 512))
    signal.signal(signal.SIGALRM, _on_alarm)
    end = start + check_s
    program = _Program(socket.socket(fileno=control), int(z.limits["max_output_bytes"]))
    base: Optional[dict[str, Any]] = None
    timeouts, load_failure = 0, None
    results: list[dict[str, Any]] = []
    for i, test in enumerate(tests):
        left = end - time.monotonic()
        if load_failure is None and base is None and timeouts < max_timeouts and left > 0:
            base, *failure = _load(program, min(timeout_s, left), exports)
            left = end - time.monotonic()
            if base is not None:
                load_failure = None
            elif failure[0] == "timeout" and left <= 0:
                load_failure = ("timeout", f"not run: the check's {check_s:g} s were used up (loading the program)")
            else:
                load_failure = tuple(failure)  # loading again would fail again
        if load_failure is not None:
            status, message = load_failure
        elif timeouts >= max_timeouts:
            status, message = "timeout", f"not run: {timeouts} tests already timed out"
        elif left <= 0 or base is None:
            status, message = "timeout", f"not run: the check's {check_s:g} s were used up"
        else:
            status, message = _run_one(program, base, setup, test, min(timeout_s, left))
            if status == "timeout":
                timeouts += 1
                program.close()  # the init kills it when the next one is spawned
            if not _alive(program):
                base = None
        results.append({"i": i, "status": status, "message": clean_text(message)})
    program.close()
    program.control.close()  # the handler forks no program from here on
    for result in results:
        frames.write_frame(report, result)
    frames.write_frame(report, {"done": True})
    os._exit(0)


def _alive(program: _Program) -> bool:
    return program.req_w is not None


def _load(program: _Program, timeout_s: float,
          exports: Optional[list[str]]) -> tuple[Optional[dict[str, Any]], str, str]:
    """A fresh program and the names the tests see, all within ``timeout_s``: reading its startup
    message and rebuilding its values too (the program writes that message; it could make it slow)."""
    timeout = (None, "timeout", f"the program did not finish loading within {timeout_s:g} s")
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        hello = program.spawn(time.monotonic() + timeout_s)
        if "load_error" in hello:
            program.close()
            return None, "error", f"the program failed to load: {str(hello['load_error'])[:500]}"
        return _namespace(program, hello, exports), "", ""
    except (frames.Timeout, _TestTimeout):
        program.close()
        return timeout
    except (frames.Closed, OSError) as exc:
        program.close()
        return None, "error", f"the program exited or was killed while loading ({describe(exc)})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
