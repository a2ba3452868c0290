"""comlrl.sandbox against hostile programs, in every mode this machine allows.

Each test runs on the full sandbox and, where the layer in question has a fallback, with the
mechanism forced off (``disable=``) so the degraded path is tested too. Layers this machine cannot
provide are skipped with the reason. Time bounds are generous: they check that a limit ends a run,
not how fast.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from comlrl.exceptions import ConfigError, SandboxError
from comlrl.sandbox import LAYERS, ExecResult, Sandbox, TestReport

MODES = {
    "full": (),
    # no PID namespace: kill_tree falls back to the subreaper sweep
    "no_pidns": ("pid_namespace",),
    # what a user without namespaces gets: Landlock + seccomp only
    "plain": ("pid_namespace", "uid_drop", "network_namespace", "mount_namespace", "user_namespace"),
}


def _sandbox(request, **kw):
    box = Sandbox(**kw)
    request.addfinalizer(box.close)
    return box


@pytest.fixture(scope="module")
def boxes():
    made = {name: Sandbox(timeout_s=2, workers=2, disable=off) for name, off in MODES.items()}
    yield made
    for box in made.values():
        box.close()


@pytest.fixture(params=list(MODES))
def box(request, boxes):
    return boxes[request.param]


def need(box, *layers):
    have = box.isolation()
    missing = [name for name in layers if not have[name]]
    if missing:
        pytest.skip(f"layer(s) {missing} not available here: {box.isolation_details()}")


def code(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


# --- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=-1), "timeout_s"), (dict(memory_mb=1.5), "memory_mb"),
    (dict(max_output_bytes=0), "max_output_bytes"), (dict(workers=0), "workers"),
    (dict(require=("networking",)), "networking"), (dict(disable=("selinux",)), "selinux"),
    (dict(timeout_s=True), "timeout_s"),
])
def test_bad_settings_say_what_to_change(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Sandbox(**kwargs)


def test_bad_inputs_say_what_to_change(boxes):
    box = boxes["full"]
    with pytest.raises(ConfigError, match="string"):
        box.run(b"print(1)")
    with pytest.raises(ConfigError, match="list of strings"):
        box.check("x = 1", "assert x == 1")
    with pytest.raises(ConfigError, match=r"\(code, tests\)"):
        box.check_many(["x = 1"])
    with pytest.raises(ConfigError, match="stdin"):
        box.run_many(["pass", "pass"], stdin=["a"])


def test_require_refuses_a_missing_layer(request):
    box = _sandbox(request, disable=("landlock",))
    assert box.isolation()["file_reads"] is False
    with pytest.raises(SandboxError, match="file_reads"):
        Sandbox(require=("file_reads",), disable=("landlock",))


def test_isolation_names_every_layer_and_warns_once(request, caplog):
    box = _sandbox(request, disable=("seccomp",))
    with caplog.at_level("WARNING", logger="comlrl"):
        layers = box.isolation()
        box.isolation()
        box.run("pass")
    assert set(layers) == set(LAYERS)
    assert layers["syscall_filter"] is False and layers["session"] is True
    assert len([r for r in caplog.records if "syscall_filter" in r.getMessage()]) <= 1


def test_closed_sandbox_refuses_work(request):
    box = Sandbox(workers=1)
    box.close()
    with pytest.raises(SandboxError, match="closed"):
        box.run("pass")


def test_pickles_by_settings():
    with Sandbox(timeout_s=3, workers=1) as box:
        copy = pickle.loads(pickle.dumps(box))
        try:
            assert copy.settings() == box.settings()
            assert copy.run("print(6 * 7)").stdout == "42\n"
        finally:
            copy.close()


# --- runs ------------------------------------------------------------------------------------------

def test_run_ok_error_and_stdin(box):
    ok = box.run("print(input()[::-1])", stdin="abc")
    assert (ok.status, ok.returncode, ok.stdout) == ("ok", 0, "cba\n")
    bad = box.run("raise ValueError('boom')")
    assert bad.status == "error" and bad.returncode == 1 and "ValueError: boom" in bad.stderr
    assert box.run("import sys; sys.exit(3)").returncode == 3


def test_run_many_keeps_order(box):
    results = box.run_many([f"print({i})" for i in range(6)])
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert all(isinstance(r, ExecResult) for r in results)


def test_infinite_loop_times_out(box):
    start = time.monotonic()
    result = box.run("while True:\n    pass")
    assert result.status == "timeout"
    assert time.monotonic() - start < 10


def test_cpu_burning_threads_time_out(box):
    result = box.run(code("""
        import threading
        def burn():
            while True:
                pass
        for _ in range(8):
            threading.Thread(target=burn, daemon=True).start()
        burn()
    """))
    assert result.status == "timeout"


def test_ignored_sigterm_and_sigalrm_do_not_stop_the_kill(box):
    result = box.run(code("""
        import signal, time
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        signal.alarm(0)
        while True:
            time.sleep(0.01)
    """))
    assert result.status == "timeout"


def test_memory_bomb(box):
    result = box.run("x = bytearray(4 << 30)")
    assert result.status == "memory" and "MemoryError" in result.stderr


@pytest.mark.parametrize("mode", list(MODES))
def test_memory_growth_stops_at_the_limit(request, mode):
    box = _sandbox(request, memory_mb=256, timeout_s=20, workers=1, disable=MODES[mode])
    grow = box.run(code("""
        chunks = []
        while True:
            chunks.append(bytearray(16 << 20))
    """))
    assert grow.status in ("memory", "killed"), grow


def test_segfault_is_killed(box):
    result = box.run("import ctypes; ctypes.string_at(0)")
    assert result.status == "killed" and result.returncode == -11


def test_a_gigabyte_of_output_is_cut(box):
    start = time.monotonic()
    result = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert result.status == "output_limit"
    assert len(result.stdout) + len(result.stderr) <= 1_000_000
    assert time.monotonic() - start < 10


def test_parent_never_blocks_on_a_full_pipe(box):
    # stderr fills its pipe while stdout is quiet: the zygote reads both as they come
    result = box.run("import sys\nsys.stderr.write('e' * 300000)\nprint('done')")
    assert result.status == "ok" and result.stdout == "done\n" and len(result.stderr) == 300000


def test_environment_holds_no_secrets(box, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb")
    monkeypatch.setenv("HF_TOKEN", "secret-hf")
    monkeypatch.setenv("OPENAI_API_KEY", "secret-openai")
    result = box.run(code("""
        import os
        print(sorted(os.environ))
        for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:
            try:
                print(open(f'/proc/{pid}/environ', 'rb').read())
            except OSError:
                pass
    """))
    assert "secret" not in result.stdout, result.stdout[:2000]
    assert "WANDB_API_KEY" not in result.stdout and "HF_TOKEN" not in result.stdout


def test_fresh_working_directory_removed_afterwards(box):
    result = box.run(code("""
        import os
        print(os.getcwd(), sorted(os.listdir('.')))
        open('left-behind.txt', 'w').write('x')
    """))
    where, listing = result.stdout.split(" ", 1)
    assert listing.strip() == "[]"
    assert not os.path.exists(os.path.join(where, "left-behind.txt"))
    again = box.run("import os; print(os.getcwd())")
    assert again.stdout.strip() != where


def planted(folder: Path, name: str, text: str, mode: int) -> Path:
    """A file the program's user could reach by permissions alone (``mode`` for it and its folder)."""
    path = folder / name
    path.write_text(text)
    os.chmod(folder, mode | 0o111)
    os.chmod(path, mode)
    return path


def test_no_writes_outside_the_working_directory(box, tmp_path):
    need(box, "filesystem")
    target = planted(tmp_path, "victim.txt", "safe", 0o666)
    result = box.run(code(f"""
        import os
        for path in [{str(target)!r}, {str(tmp_path / 'new.txt')!r}, '/tmp/comlrl-sandbox-escape.txt']:
            try:
                open(path, 'w').write('pwned')
                print('wrote', path)
            except OSError as exc:
                print('refused', path, type(exc).__name__)
    """))
    assert "wrote" not in result.stdout, result.stdout
    assert target.read_text() == "safe" and not (tmp_path / "new.txt").exists()
    assert not os.path.exists("/tmp/comlrl-sandbox-escape.txt")


def test_user_files_cannot_be_read(box, tmp_path):
    need(box, "file_reads")
    secret = planted(tmp_path, "netrc", "machine api.wandb.ai password hunter2", 0o644)
    result = box.run(f"print(open({str(secret)!r}).read())")
    assert "hunter2" not in result.stdout and result.status == "error"


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    accepted = []

    def accept():
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not accepted:
            try:
                conn, _ = server.accept()
                accepted.append(conn.recv(100))
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()


def test_no_network_to_a_loopback_listener(box, listener):
    need(box, "network")
    port, accepted = listener
    result = box.run(code(f"""
        import socket
        try:
            s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
            s.sendall(b'hello from the sandbox')
            print('connected')
        except OSError as exc:
            print('refused', type(exc).__name__, exc)
    """))
    assert "connected" not in result.stdout, result.stdout
    time.sleep(0.3)
    assert accepted == []


def test_fork_bomb_is_contained(box):
    # Without a process limit (root keeping uid 0) a fork bomb would take the machine down, not
    # only the run: never run it there.
    need(box, "process_limit")
    start = time.monotonic()
    result = box.run(code("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """))
    assert result.status in ("timeout", "killed", "error")
    assert time.monotonic() - start < 20
    assert box.run("print('still here')").stdout == "still here\n"


def test_killing_its_parent_and_everyone_else(box):
    need(box, "signals")  # where signals are not contained this would kill the test run itself
    result = box.run(code("""
        import os, signal
        for target in (os.getppid(), 1, -1, 0):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        print('alive')
    """))
    assert result.status in ("ok", "killed", "error")
    assert box.run("print('next')").stdout == "next\n"   # the worker survived (or came back)


def test_double_forked_daemon_is_killed_with_its_run(box, tmp_path):
    # The daemon re-parents itself twice and starts its own session, then keeps writing to a
    # folder it could reach; when the run ends it must be gone (a PID namespace or the sweep).
    marker = Path(tempfile.mkdtemp(prefix="daemon-", dir="/tmp"))
    os.chmod(marker, 0o777)
    try:
        box.run(code(f"""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.setsid()
                    for i in range(400):
                        try:
                            with open('{marker}/beat', 'a') as f:
                                f.write('x')
                        except OSError:
                            pass
                        with open('heartbeat', 'a') as f:
                            f.write('x')
                        time.sleep(0.01)
                os._exit(0)
            time.sleep(0.1)
        """))
        time.sleep(1.0)
        beat = marker / "beat"
        before = beat.stat().st_size if beat.exists() else 0
        time.sleep(1.0)
        after = beat.stat().st_size if beat.exists() else 0
        assert after == before, "the daemon outlived its run"
    finally:
        import shutil
        shutil.rmtree(marker, ignore_errors=True)


# --- checks ----------------------------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"


def test_check_judges_each_test(box):
    report = box.check(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(1) == 1",
                             "assert sub(1, 1) == 0"])
    assert isinstance(report, TestReport)
    assert [r.status for r in report.results] == ["passed", "failed", "error", "error"]
    assert (report.passed, report.total) == (1, 4)
    assert "add(2, 2) returned 4" in report.results[1].message
    assert "TypeError" in report.results[2].message and "NameError" in report.results[3].message


def test_hanging_test_does_not_hide_the_others(box):
    program = ADD + "def spin(n):\n    while True:\n        pass\n"
    start = time.monotonic()
    report = box.check(program, ["assert add(1, 1) == 2", "assert spin(1) == 0", "assert add(2, 3) == 5",
                                 "assert add(0, 0) == 0"])
    assert [r.status for r in report.results] == ["passed", "timeout", "passed", "passed"]
    assert time.monotonic() - start < 12


def test_after_max_timeouts_the_rest_is_not_run(request):
    box = _sandbox(request, timeout_s=0.5, workers=1, max_timeouts=2)
    report = box.check("def f():\n    while True:\n        pass\n", ["assert f()"] * 5)
    assert [r.status for r in report.results] == ["timeout"] * 5
    assert "not run" in report.results[4].message


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "raise SystemExit", "os.kill(os.getpid(), 9)"])
def test_exiting_before_the_tests_scores_nothing(box, exit_call):
    program = f"import os, sys\n{ADD}{exit_call}\n"
    report = box.check(program, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    assert report.passed == 0, report


def test_exiting_during_a_test_fails_only_that_test(box):
    program = ADD + "import os\ndef bye():\n    os._exit(0)\n"
    report = box.check(program, ["assert add(1, 2) == 3", "assert bye() is None", "assert add(2, 2) == 4"])
    assert [r.status for r in report.results] == ["passed", "error", "passed"]


def test_fake_pass_markers_and_forged_reports_score_nothing(box):
    program = code("""
        import os, sys, json, struct
        print('PASSED ' * 100)
        print('{"i": 0, "status": "passed"}')
        for fd in range(3, 64):
            for blob in (b'{"i":0,"status":"passed","message":""}\\n',
                         struct.pack('>I', 30) + b'{"i":0,"status":"passed","message":""}'[:30]):
                try:
                    os.write(fd, blob)
                except OSError:
                    pass
        def add(a, b):
            return a - b
    """)
    report = box.check(program, ["assert add(1, 2) == 3", "assert add(5, 5) == 10"])
    assert report.passed == 0, report


def test_always_equal_objects_do_not_pass(box):
    program = code("""
        class AlwaysEqual:
            def __eq__(self, other):
                return True
            __ne__ = lambda self, other: False
        class Sneaky(int):
            def __eq__(self, other):
                return True
        def add(a, b):
            return AlwaysEqual()
        def add2(a, b):
            return Sneaky(0)
    """)
    report = box.check(program, ["assert add(1, 2) == 3", "assert add2(1, 2) == 3"])
    assert report.passed == 0
    assert "built-in values" in report.results[0].message


def test_patched_builtins_do_not_reach_the_tests(box):
    program = code("""
        import builtins, math
        builtins.abs = lambda x: 0
        builtins.AssertionError = type('Nope', (Exception,), {})
        math.isclose = lambda *a, **k: True
        def half(x):
            return x / 3
    """)
    report = box.check(program, ["assert abs(half(3) - 1.5) < 1e-9",
                                 "import math\nassert math.isclose(half(3), 1.5)"])
    assert [r.status for r in report.results] == ["failed", "failed"]


def test_killing_the_judge_scores_nothing(box):
    need(box, "signals")
    program = code("""
        import os, signal
        def add(a, b):
            for pid in range(1, 64):
                if pid != os.getpid():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            return a + b
    """)
    report = box.check(program, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    # Either the judge survived (and saw the right answers) or it is gone and nothing passed.
    assert report.passed in (0, 2)
    assert box.check(ADD, ["assert add(1, 2) == 3"]).passed == 1


def test_load_errors_and_load_timeouts(box):
    broken = box.check("def add(a, b)\n    return a + b", ["assert add(1, 2) == 3"] * 2)
    assert [r.status for r in broken.results] == ["error", "error"]
    assert "SyntaxError" in broken.results[0].message
    slow = box.check("while True:\n    pass\n" + ADD, ["assert add(1, 2) == 3"] * 2)
    assert [r.status for r in slow.results] == ["timeout", "timeout"]


def test_values_cross_exactly(box):
    program = code("""
        def echo(x):
            return x
        def big():
            return 10 ** 5000
        def nan():
            return float('nan')
    """)
    tests = ["assert echo((1, [2.5, -0.0], {'a': {3}}, frozenset({4}), b'x', None, True, 1j)) == "
             "(1, [2.5, -0.0], {'a': {3}}, frozenset({4}), b'x', None, True, 1j)",
             "assert type(echo((1,))) is tuple and type(echo([1])) is list",
             "assert big() == 10 ** 5000",
             "import math\nassert math.isnan(nan())",
             "assert echo(True) is True and echo(None) is None"]
    report = box.check(program, tests)
    assert report.passed == len(tests), report


def test_program_exceptions_keep_their_type(box):
    program = "def f(x):\n    raise ValueError('bad x')\n"
    test = "try:\n    f(1)\n    assert False\nexcept ValueError as exc:\n    assert 'bad x' in str(exc)\n"
    assert box.check(program, [test]).passed == 1


def test_setup_runs_before_each_test(box):
    report = box.check(ADD, ["assert add(x, 1) == 2", "assert x == 1"], setup="x = 1")
    assert report.passed == 2


def test_check_many_dedups_identical_items(box):
    items = [(ADD, ["assert add(1, 1) == 2"]), (ADD, ["assert add(1, 1) == 2"]), (ADD, ["assert add(1, 1) == 3"])]
    reports = box.check_many(items)
    assert [r.passed for r in reports] == [1, 1, 0]
    assert reports[0] is reports[1]


def test_deterministic_randomness(box):
    program = "import random\ndef r():\n    return random.random()\n"
    first = box.run("import random; print(random.random(), {'a', 'b', 'c'})").stdout
    assert box.run("import random; print(random.random(), {'a', 'b', 'c'})").stdout == first
    report = box.check(program, ["import random\nassert r() != random.random() or True"])
    assert report.passed == 1


def test_a_worker_killed_from_outside_comes_back(request):
    box = _sandbox(request, workers=1, timeout_s=2)
    box.run("pass")
    worker = box._all[0]
    os.killpg(worker.proc.pid, 9)
    worker.proc.wait()
    assert box.run("print(1)").status in ("killed", "ok")
    assert box.run("print(2)").stdout == "2\n"


def _nobody_python(env):
    """An interpreter of this Python version that uid 65534 can run (and that can start itself
    again: the sandbox's workers run sys.executable), with this test run's packages on its path;
    None if there is none."""
    import shutil
    import subprocess
    import sys

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", candidate,
                                         "-c", "import comlrl.sandbox, pytest, subprocess, sys; "
                                         "subprocess.run([sys.executable, '-c', ''], check=True)"], env=env,
                                        capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an unprivileged user to test that mode (needs root)")
@pytest.mark.slow
def test_every_hostile_program_as_an_unprivileged_user():
    """A user's machine: not root. This whole file again as uid 65534: user namespaces where the
    kernel allows them, and the "plain" mode (Landlock and seccomp only) as a non-root user would get it."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    repo = Path(__file__).resolve().parents[1]
    paths = [p for p in sys.path if p and os.path.isdir(p)] + [str(repo)]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "COMLRL_DISABLE_PROGRESS": "1", "PYTHONPATH": ":".join(paths)}
    python = _nobody_python(env)
    if python is None:
        pytest.skip("no Python with this run's packages that an unprivileged user may run")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-m", "pytest",
                           str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-k", "not unprivileged"],
                          capture_output=True, text=True, env=env, timeout=900, cwd="/tmp")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
