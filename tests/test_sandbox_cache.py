"""The sandbox's result cache: a check of an item seen recently (same program, tests, setup and
exports) is answered without running it again, bounded to the ``cache_size`` most recent items."""

from __future__ import annotations

import pickle

import pytest

from comlrl.exceptions import ConfigError
from comlrl.sandbox import Sandbox

ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def counted(request):
    """A one-worker sandbox with a cache of 2, and the items its workers were asked to check."""
    box = Sandbox(timeout_s=5, workers=1, cache_size=2)
    request.addfinalizer(box.close)
    ran = []
    real = box._check_one

    def check_one(worker, item):
        ran.append(item[0])
        return real(worker, item)
    box._check_one = check_one
    return box, ran


def test_a_repeated_check_is_answered_from_the_cache(counted):
    box, ran = counted
    first = box.check(ADD, ["assert add(1, 1) == 2", "assert add(1, 1) == 3"])
    again = box.check_many([(ADD, ["assert add(1, 1) == 2", "assert add(1, 1) == 3"])])[0]
    assert again is first and (first.passed, first.total) == (1, 2)
    assert ran == [ADD] and box.cache_hits == 1
    # another test list, setup or exports is another item: run
    box.check(ADD, ["assert add(1, 1) == 2"])
    box.check(ADD, ["assert add(1, 1) == 2"], exports=["add"])
    assert ran == [ADD] * 3


def test_the_cache_keeps_the_most_recently_used_items_only(counted):
    box, ran = counted
    a, b, c = (f"def f():\n    return {i}\n" for i in range(3))
    for code in (a, b, a, c):        # c evicts b (a was used after b)
        box.check(code, ["assert f() == 0"])
    assert ran == [a, b, c]
    box.check(a, ["assert f() == 0"])
    box.check(b, ["assert f() == 0"])
    assert ran == [a, b, c, b]


def test_cache_size_zero_runs_every_check(request):
    box = Sandbox(timeout_s=5, workers=1, cache_size=0)
    request.addfinalizer(box.close)
    first = box.check(ADD, ["assert add(1, 1) == 2"])
    second = box.check(ADD, ["assert add(1, 1) == 2"])
    assert first is not second and first.results == second.results and box.cache_hits == 0


def test_a_report_of_a_dead_worker_is_not_kept(counted, monkeypatch):
    box, ran = counted
    monkeypatch.setattr(box._all[0], "request", lambda *a, **k: None)  # the worker "died"
    dead = box.check(ADD, ["assert add(1, 1) == 2"])
    assert dead.results[0].status == "error" and "died" in dead.results[0].message
    monkeypatch.undo()
    box._check_one = type(box)._check_one.__get__(box)
    assert box.check(ADD, ["assert add(1, 1) == 2"]).passed == 1 and box.cache_hits == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "8", 1 << 21])
def test_cache_size_is_checked_at_construction(value):
    with pytest.raises(ConfigError, match="cache_size"):
        Sandbox(cache_size=value)


def test_cache_size_is_a_setting_kept_by_pickling():
    with Sandbox(workers=1, cache_size=7) as box:
        copy = pickle.loads(pickle.dumps(box))
        try:
            assert copy.cache_size == 7 and copy.settings() == box.settings()
        finally:
            copy.close()
