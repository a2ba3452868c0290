"""The judge against a program's messages built to make it slow: loading is bounded by
``timeout_s`` and values are rebuilt in time linear in their size. Each test failed on the code
before issue 27's fixes."""

from __future__ import annotations

import time

import pytest

from comlrl.sandbox._runtime import codec
from sandbox_support import box, boxes, code  # noqa: F401

_M = 2 ** 61 - 1  # CPython hashes an int modulo this: k * _M all hash to 0


def _colliding(count: int) -> list:
    return [["I", hex(k * _M)] for k in range(1, count + 1)]


@pytest.mark.parametrize("kind", ["s", "F", "d"])
def test_values_built_to_collide_are_refused_quickly(kind):
    """Item 5 at the unit: 30,000 ints of one hash took about 20 s to rebuild as a set
    (quadratic); a set or dict whose elements share a hash that many times is malformed."""
    def value(items):
        return [kind, [[k, 0] for k in items] if kind == "d" else items]

    def seconds(run) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        return best

    def refused():
        with pytest.raises(ValueError, match="hash"):
            codec.decode(data)

    data = value(_colliding(30_000))
    ordinary = value([["I", hex(k)] for k in range(1, 30_001)])  # as many values, distinct hashes
    # A ratio in one run (a loaded machine slows both alike): rebuilding the colliding set took about
    # 600 times as long as the ordinary one; refused in linear time, it costs about what decoding does.
    assert seconds(refused) < 25 * seconds(lambda: codec.decode(ordinary))
    # nested inside other values too
    with pytest.raises(ValueError, match="hash"):
        codec.decode(["l", [["t", [1, data]]]])


def test_ordinary_sets_and_dicts_still_cross():
    values = [set(range(50_000)), frozenset({-1, -2, 0, 1.5, "a", (1, 2)}), {i: str(i) for i in range(1000)},
              {(1, 2): [3], "x": {"y": {4}}}, {k * _M for k in range(1, 9)}]
    for value in values:
        assert codec.decode(codec.encode(value)) == value


def test_a_startup_message_built_to_be_slow_is_refused_quickly(box):
    """Item 5: the judge decoded the program's startup message (its exported names and values)
    without a time limit: a set of hash-colliding ints made each loading take 20 s against
    timeout_s=2 (this check of two tests: the whole check_timeout_s of 8 s). The value is now
    refused in linear time (the rest of the message is used)."""
    program = code(f"""
        import json, os
        items = [["I", hex(k * {_M})] for k in range(1, 30001)]
        os.write(4, (json.dumps({{"gen": 1, "names": {{"functions": ["f"], "values": {{"S": ["s", items]}}}}}})
                     + "\\n").encode())
        os._exit(0)
    """)
    start = time.monotonic()
    report = box.check(program, ["assert S is not None", "assert f() == 1"])
    elapsed = time.monotonic() - start
    assert report.passed == 0, report
    assert "NameError" in report.results[0].message, report  # S was left out, f was there (and gone)
    assert elapsed < box.timeout_s + 3, (elapsed, report)
    assert box.check("def f():\n    return 1\n", ["assert f() == 1"]).passed == 1


class _SlowProgram:
    """A program process whose startup message takes ``seconds`` of the judge's CPU to read."""

    def __init__(self, seconds: float):
        self.seconds, self.closed = seconds, False

    def spawn(self, deadline: float) -> dict:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass
        return {"gen": 1, "names": {"functions": ["f"], "values": {}}}

    def close(self) -> None:
        self.closed = True


def test_loading_is_timed_whatever_makes_it_slow():
    """Item 5: the judge's clock for a test did not run while it loaded the program: anything
    slow in the judge then (reading, rebuilding values) went unbounded."""
    import signal

    from comlrl.sandbox._runtime import judge

    previous = signal.signal(signal.SIGALRM, judge._on_alarm)
    try:
        program = _SlowProgram(3.0)
        start = time.monotonic()
        base, status, message = judge._load(program, 0.5, None)
        elapsed = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert (base, status) == (None, "timeout") and "0.5 s" in message and program.closed
    assert elapsed < 2.0, elapsed


def test_a_return_value_built_to_be_slow_fails_its_test_quickly(box):
    program = code(f"""
        def f():
            return {{k * {_M} for k in range(1, 3001)}}
    """)
    report = box.check(program, ["assert len(f()) == 3000"])
    assert report.results[0].status == "error" and "hash" in report.results[0].message, report
