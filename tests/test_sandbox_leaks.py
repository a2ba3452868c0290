"""What a program can learn that it must not: earlier requests' tests, code, input and output left
in the memory it was forked from; the host's processes through /proc; the trainer's paths in its
tracebacks. Each test failed on the code before issue 27's fixes."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import pytest

import comlrl
from sandbox_support import as_root, box, boxes, code, make_sandbox, need, one_worker  # noqa: F401

# A program that counts the places in its own address space holding `marker`, without `marker`
# itself ever being in its code or memory: it knows a prefix and a hash. It finds its memory as
# an attacker would where /proc/self/maps is closed (Landlock): pages probed with write() into a
# pipe (EFAULT where nothing is mapped), from the heap's end down and around every live object.
_SCAN = '''
import ctypes, gc, hashlib, os

def _scan(prefix, want, length):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    page = os.sysconf("SC_PAGE_SIZE")
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)

    def mapped(addr):
        if libc.write(w, ctypes.c_void_p(addr), 1) == 1:
            os.read(r, 1)
            return True
        return False

    def extend(start, step):
        for _ in range(1 << 15):
            if not mapped(start + step):
                break
            start += step
        return start

    top = libc.sbrk(0) or 0
    starts = {(top - 1) // page * page} | {id(o) // page * page for o in gc.get_objects()}
    ranges = []
    for start in sorted(starts):
        if start > 0 and not any(a <= start < b for a, b in ranges) and mapped(start):
            ranges.append((extend(start, -page), extend(start, page) + page))
    hits = 0
    for a, b in ranges:
        data = ctypes.string_at(a, b - a)
        i = data.find(prefix)
        while i >= 0:
            hits += hashlib.sha256(data[i:i + length]).hexdigest() == want
            i = data.find(prefix, i + 1)
    return hits
'''


def _marker() -> str:
    return "HARVEST-" + secrets.token_hex(12)


def scanner(marker: str, *, read_stdin: bool = False, as_module: bool = False) -> str:
    """The scanning program for ``marker``: prints its count (a run), or exports it as ``hits``
    (a check); with ``read_stdin`` it first reads its input (the positive control)."""
    call = f"_scan({marker[:8].encode()!r}, {hashlib.sha256(marker.encode()).hexdigest()!r}, {len(marker)})"
    head = "held = input()\n" if read_stdin else ""
    return head + _SCAN + (f"hits = {call}\n" if as_module else f"print({call})\n")


def test_the_scanner_finds_what_its_memory_holds(one_worker):
    marker = _marker()
    result = one_worker.run(scanner(marker, read_stdin=True), stdin=marker)
    assert result.status == "ok" and int(result.stdout) >= 1, result


def test_tests_of_earlier_checks_are_not_in_a_later_programs_memory(one_worker):
    """Issue 27 item 1: the zygote read every request's tests and every result (failure messages
    quote the test line) into its heap and forked the next requests from it: a program scanning
    its memory found `assert f(x) == y` of earlier checks of the same problem."""
    marker = _marker()
    report = one_worker.check("def f(x):\n    return 0\n", [f"assert f({i}) == {marker!r}" for i in range(8)])
    assert report.passed == 0 and marker in report.results[0].message, report
    for _ in range(2):
        run = one_worker.run(scanner(marker))
        assert (run.status, run.stdout) == ("ok", "0\n"), run
    check = one_worker.check(scanner(marker, as_module=True), ["assert hits == 0"])
    assert check.passed == 1, check


def test_code_input_and_output_of_earlier_runs_are_not_in_a_later_programs_memory(one_worker):
    """Item 1 for runs: another sample's code (its answer), its input and its output were all in
    the memory later programs were forked from."""
    for make in (lambda m: (f"# {m}\npass\n", ""),                          # another sample's code
                 lambda m: ("input()\n", m),                                 # its input
                 lambda m: (f"print({m[:8]!r} + {m[8:]!r})\n", "")):         # its output
        marker = _marker()
        earlier, stdin = make(marker)
        assert one_worker.run(earlier, stdin).status == "ok"
        run = one_worker.run(scanner(marker))
        assert (run.status, run.stdout) == ("ok", "0\n"), (earlier, run)


@pytest.mark.skipif(not as_root(), reason="reads the zygote's memory through /proc (needs root)")
def test_the_zygote_never_holds_a_request_or_an_answer(request):
    """Item 1 at the source: the process every request is forked from holds no byte of any
    request (code, input, tests) or answer (output, failure messages), however many it served."""
    box = make_sandbox(request, workers=1, timeout_s=5)
    marker = _marker()
    box.run(f"# {marker}\nprint({marker[:8]!r} + {marker[8:]!r})", stdin=marker)
    box.check(f"# {marker}\ndef f(x):\n    return 0\n", [f"assert f(1) == {marker!r}"] * 3)
    zygote = box._all[0].proc.pid
    found = 0
    with open(f"/proc/{zygote}/maps") as maps, open(f"/proc/{zygote}/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("r") and "[vvar" not in line and "[vsyscall" not in line:
                start, end = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(start)
                    found += mem.read(end - start).count(marker.encode())
                except OSError:
                    pass
    assert found == 0


def test_host_processes_are_not_listed_through_proc(box):
    """Should-fix of issue 27: with a PID namespace, the host's /proc still answered stat() for
    every host pid (and its owner): the trainer's pid was there to see."""
    need(box, "pid_namespace")
    me = os.getpid()
    result = box.run(code(f"""
        import os
        seen = [p for p in range(1, 1 << 15) if os.path.exists(f"/proc/{{p}}")]
        print(os.path.exists("/proc/{me}"), len(seen), os.path.exists("/proc/self"))
    """))
    mine, count, own = result.stdout.split()
    assert mine == "False" and int(count) <= 4, result  # the request's init and program
    assert own == "True", result


def test_tracebacks_show_the_program_as_python_would(box):
    """Should-fix of issue 27: a program's traceback began with the sandbox's own frames, showing
    the repository's path (the reward feedback and logs carried it); it now reads as `python
    program.py`'s would, source lines included."""
    repo = str(Path(comlrl.__file__).resolve().parents[1])
    result = box.run(code("""
        def f(x):
            raise ValueError("bad " + x)
        f("input")
    """))
    assert result.status == "error", result
    assert repo not in result.stderr and "_runtime" not in result.stderr, result.stderr
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"<program>\", line 3, in <module>")
    assert 'raise ValueError("bad " + x)' in result.stderr and result.stderr.endswith("ValueError: bad input\n")
    syntax = box.run("def f(:\n    pass\n")
    assert "SyntaxError" in syntax.stderr and repo not in syntax.stderr and "_runtime" not in syntax.stderr, syntax
    thread = box.run(code("""
        import threading
        def boom():
            raise KeyError("in a thread")
        t = threading.Thread(target=boom)
        t.start()
        t.join()
    """))
    assert "KeyError: 'in a thread'" in thread.stderr and repo not in thread.stderr, thread
