"""How a run ends: as Python ends a program (non-daemon threads waited for, atexit handlers run,
all within ``timeout_s``), and everything it started gone afterwards, however it forks. Each test
failed on the code before issue 27's fixes."""

from __future__ import annotations

import os
import secrets
import signal
import time

import pytest

from sandbox_support import MODES, box, boxes, code, make_sandbox  # noqa: F401


def test_non_daemon_threads_are_waited_for(box):
    """Item 6: run() ended the program when its main thread returned, killing its non-daemon
    threads: their later output was lost."""
    result = box.run(code("""
        import threading, time
        def later():
            time.sleep(0.3)
            print("from the thread", flush=True)
        threading.Thread(target=later).start()
        print("main done")
    """))
    assert (result.status, result.stdout) == ("ok", "main done\nfrom the thread\n"), result


def test_cpu_burning_non_daemon_threads_time_out(box):
    """Item 6: eight CPU-burning non-daemon threads "finished" in 0.7 s with status ok."""
    start = time.monotonic()
    result = box.run(code("""
        import threading
        def burn():
            while True:
                pass
        for _ in range(8):
            threading.Thread(target=burn).start()
    """))
    assert result.status == "timeout", result
    assert time.monotonic() - start >= box.timeout_s * 0.9


def test_exit_status_atexit_and_daemon_threads_as_python_has_them(box):
    result = box.run(code("""
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit", flush=True))
        def worker():
            time.sleep(0.2)
            print("worker", flush=True)
        threading.Thread(target=worker).start()
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        sys.exit(3)
    """))
    assert (result.status, result.returncode, result.stdout) == ("error", 3, "worker\natexit\n"), result
    raised = box.run("import atexit\natexit.register(lambda: print('atexit'))\nraise ValueError('x')\n")
    assert (raised.returncode, raised.stdout) == (1, "atexit\n") and "ValueError: x" in raised.stderr, raised
    quick = box.run("import os, atexit\natexit.register(lambda: print('no'))\nos._exit(0)\n")
    assert (quick.status, quick.stdout) == ("ok", ""), quick


def test_programs_run_with_the_collector_and_signals_of_a_program(box):
    """The handler forking a program turns its own collector off and takes SIGCHLD wake-ups:
    neither reaches the program."""
    probe = "import gc, signal\ndef state():\n    return [gc.isenabled(), signal.getsignal(signal.SIGCHLD) == 0]\n"
    assert box.run(probe + "print(state())").stdout == "[True, True]\n"
    assert box.check(probe, ["assert state() == [True, True]"]).passed == 1


def _named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("mode", ["no_pidns", "plain"])
def test_hopping_process_chains_are_killed_without_a_pid_namespace(request, mode):
    """Should-fix of issue 27 on real processes: chains of processes that fork and exit as fast as
    they can (each new one an orphan the sweep must find again), next to idle decoys, are all gone
    when the run ends (without the PID namespace or the cgroup: the subreaper sweep alone)."""
    box = make_sandbox(request, workers=1, timeout_s=10, disable=MODES[mode] + ("cgroup",))
    name = "hop" + secrets.token_hex(5)
    try:
        result = box.run(code(f"""
            import ctypes, os, time
            libc = ctypes.CDLL(None)
            for i in range(24):
                if os.fork() == 0:
                    libc.prctl(15, {name.encode()!r}, 0, 0, 0)  # PR_SET_NAME: how the test finds them
                    os.setsid()
                    end = time.monotonic() + 20                    # a bound, should the sweep fail
                    while time.monotonic() < end:
                        if i % 3 == 0:
                            time.sleep(0.01)                       # a decoy
                            continue
                        try:
                            if os.fork():
                                os._exit(0)
                        except OSError:
                            pass
                    os._exit(0)
            time.sleep(0.3)
        """))
        assert result.status in ("ok", "error"), result
        time.sleep(0.3)
        assert _named(name) == [], "processes outlived their run"
    finally:
        from comlrl.sandbox._runtime.cgroups import _kill_members

        _kill_members(lambda: _named(name))  # should the sweep have failed: leave nothing running here


class _World:
    """A fake process table for the sweep: one child of ours that, ``hops`` times, has forked and
    exited between being listed and being signalled (its child, an orphan, is ours next): an
    adversary faster than any sweep, for a while. Its PIDs lie above the kernel's largest pid_max
    (2**22), so none is ever this process's own: with small numbers a worker whose PID fell among
    them listed itself as its own child, and the sweep grew its list without end."""

    FIRST = 2**22 + 100

    def __init__(self, hops: int):
        self.hops, self.alive, self.stopped, self.next = hops, {self.FIRST}, set(), self.FIRST + 1

    def children(self, pid: int) -> list[int]:
        return sorted(self.alive) if pid == os.getpid() else []

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.alive:
            raise ProcessLookupError(pid)
        if pid not in self.stopped and self.hops:
            self.hops -= 1
            self.alive.discard(pid)
            self.alive.add(self.next)
            self.next += 1
            raise ProcessLookupError(pid)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGKILL:
            self.alive.discard(pid)


def test_the_sweep_has_no_round_limit(monkeypatch):
    """Should-fix of issue 27: the sweep without a PID namespace gave up after 200 rounds,
    leaving whatever still ran; it now goes on until nothing is left."""
    from comlrl.sandbox._runtime import server

    world = _World(hops=500)
    monkeypatch.setattr(server, "_children", world.children)
    monkeypatch.setattr(server.os, "kill", world.kill)
    monkeypatch.setattr(server, "_reap", lambda: None)
    monkeypatch.setattr(server.time, "sleep", lambda s: None)
    server._sweep()
    assert world.alive == set()


@pytest.mark.skipif(os.geteuid() != 0, reason="unshares a PID namespace in a helper (needs root)")
def test_the_pid_namespace_helper_returns_while_its_child_lives():
    """The helper path (a user namespace's): the child it forked held the pipe the caller reads to
    its end, so the call waited for the child to exit, and a handler waiting to be released by
    the zygote never was (every request of an unprivileged user's worker hung until its timeout)."""
    from comlrl.sandbox._runtime import layers, osapi

    tester = os.fork()
    if tester == 0:  # a subreaper of its own (as the zygote is): the helper's child comes back to it
        code = 3
        try:
            osapi.prctl(osapi.PR_SET_CHILD_SUBREAPER, 1)
            z = layers.Zygote(base_dir="/tmp", limits={}, pid_helper=True)
            start = time.monotonic()
            pid = layers.fork_in_new_pid_namespace(z, lambda: (time.sleep(3), os._exit(0)))
            code = 0 if time.monotonic() - start < 2.0 else 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        finally:
            os._exit(code)
    _, status = os.waitpid(tester, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the helper waited for its child"
