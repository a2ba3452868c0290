"""The GPU check's runner and report (run by scripts/gpu_check.sh, which sets up the environments).

    python scripts/gpu_check.py [--dry-run] --report REPORT.txt [--setup SETUP.json]
        [--vllm-python PY] [--comlrl-python PY] [--trl-python PY] [--skip tests,vllm,bench] ...

Runs, each in its own process, and reports in ONE text report (and REPORT.json beside it):

1-4. tests/test_cuda.py (bf16, agent_devices, torchrun/NCCL, the lean decoder on CUDA), grouped by
     test-name prefix;
5.   its vLLM tests with the interpreter that has the real vLLM (``--vllm-python``);
6.   benchmarks/throughput.py on model d (Qwen2.5-0.5B's shape, random init) in bf16 on the GPU,
     side by side with comlrl 1.4.3 and TRL when their interpreters are given.

``--dry-run`` exercises all of it on a CPU: the CUDA tests report "skipped: no CUDA", and the
benchmark runs the tiny model a (float32, CPU, 1 epoch of 8 new tokens). Only the standard library
is imported here: every check runs in a subprocess of the interpreter it needs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = "tests/test_cuda.py"
# (key, title, test-name prefix): the report's sections for tests/test_cuda.py, in order.
GROUPS = [
    ("bf16", "bf16 training on CUDA", "test_bf16_"),
    ("agent_devices", "agent_devices: agents on GPUs, checkpoints and resume", "test_agent_devices_"),
    ("torchrun", "torchrun on GPUs (2 processes over NCCL need 2 GPUs)", "test_torchrun_"),
    ("fsdp2", "FSDP2: sharded agents over NCCL (2 processes need 2 GPUs)", "test_fsdp2_"),
    ("lean_decoder", "lean decoder == transformers on CUDA (logits, sampled tokens, stacked agents, bf16)",
     "test_lean_decoder_"),
    ("vllm", "vLLM rollout backend, the real vLLM on a tiny model", "test_vllm_"),
]
PEER_NAMES = {"comlrl": "comlrl 1.4.3", "trl": "TRL GRPO (1 policy)"}
MIXED_RUN = "comlrl (this tree), mixed bf16"  # benchmarks/throughput.py's name of its --mixed-precision run
BENCH_TITLE = "throughput: the seed workload side by side with comlrl 1.4.3 and TRL"

PROBE = r"""
import importlib.metadata as md, json, platform, sys
out = {"python": sys.executable, "python_version": platform.python_version()}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
for name in ("torch", "transformers", "vllm", "trl", "comlrl", "peft", "datasets"):
    out[name] = version(name)
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if out["cuda_available"]:
        out["gpus"] = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                       for i in range(torch.cuda.device_count())]
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def sh(cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None) -> tuple[int, str]:
    """Run ``cmd`` from the repository root; (exit code, combined output). 124 on a timeout."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\n(timed out after {timeout:.0f} s)"
    except OSError as exc:
        code, output = 127, f"{type(exc).__name__}: {exc}"
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n{output}")
    return code, output


def probe(python: str) -> dict:
    code, output = sh([python, "-c", PROBE], timeout=300)
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"python": python, "error": output.strip().splitlines()[-1] if output.strip() else f"exit {code}"}


def git_commit() -> str:
    if shutil.which("git") is None:
        return "unknown"
    code, output = sh(["git", "rev-parse", "--short", "HEAD"], timeout=30)
    dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"], timeout=30)[1].strip()
    return (output.strip() + (" (with uncommitted changes)" if dirty else "")) if code == 0 else "unknown"


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    code, output = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                      timeout=60)
    return "; ".join(line.strip() for line in output.splitlines() if line.strip()) if code == 0 else None


# ------------------------------------------------------------------------------------------------
# tests/test_cuda.py, reported by group
# ------------------------------------------------------------------------------------------------

def run_pytest(python: str, selection: str, workdir: Path, name: str, timeout: float) -> tuple[list[dict], str]:
    """Run tests/test_cuda.py -k ``selection``; one dict per test case (name, status, seconds, detail)."""
    xml = workdir / f"junit-{name}.xml"
    log = workdir / f"pytest-{name}.log"
    cmd = [python, "-m", "pytest", CUDA_TESTS, "-k", selection, "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "junit_family=xunit2"]
    code, output = sh(cmd, timeout=timeout, log=log)
    if not xml.is_file():
        tail = " | ".join(output.strip().splitlines()[-3:])
        return [], f"pytest did not run (exit {code}): {tail} (log: {log})"
    cases = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        status, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                detail = (child.get("message") or child.text or "").strip().splitlines()[0][:300] if \
                    (child.get("message") or child.text or "").strip() else child.tag
            elif child.tag == "skipped":
                status, detail = "skipped", (child.get("message") or "").strip()
        cases.append({"name": case.get("name"), "status": status, "seconds": float(case.get("time") or 0),
                      "detail": _skip_reason(detail) if status == "skipped" else detail})
    note = "" if code in (0, 5) or any(c["status"] == "failed" for c in cases) else \
        f"pytest exited {code} (log: {log})"
    return cases, note


def _skip_reason(message: str) -> str:
    # junit messages of skipif marks look like "no CUDA"; of pytest.skip() calls the same, sometimes
    # prefixed with the location: keep the reason only.
    return message.split(": ", 1)[1] if message.startswith(("/", "tests/")) and ": " in message else message


def group_section(key: str, title: str, cases: list[dict], note: str = "", skipped: str = "") -> dict:
    if skipped:
        return {"key": key, "title": title, "status": f"skipped: {skipped}", "items": []}
    if not cases:
        return {"key": key, "title": title, "status": "failed" if note else "no tests",
                "items": [], "note": note}
    statuses = {c["status"] for c in cases}
    if "failed" in statuses:
        status = "failed"
    elif statuses == {"skipped"}:
        reasons = sorted({c["detail"] for c in cases})
        status = f"skipped: {reasons[0]}" if len(reasons) == 1 else "skipped: " + "; ".join(reasons)
    elif statuses == {"passed"}:
        status = "passed"
    else:
        status = "passed (some skipped)"
    return {"key": key, "title": title, "status": status, "items": cases, "note": note}


def split_groups(cases: list[dict], keys: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {key: [] for key in keys}
    out["other"] = []
    prefixes = {prefix: key for key, _, prefix in GROUPS}
    for case in cases:
        key = next((k for p, k in prefixes.items() if case["name"].startswith(p)), "other")
        out.setdefault(key, []).append(case)
    return out


# ------------------------------------------------------------------------------------------------
# the throughput benchmark
# ------------------------------------------------------------------------------------------------

def run_bench(python: str, args, workdir: Path, peers: dict[str, str | None]) -> dict:
    """benchmarks/throughput.py on model d in bf16 on the GPU (dry run: model a, float32, CPU)."""
    result_json = workdir / "throughput.json"
    if args.dry_run:
        spec = dict(models="a", device="cpu", dtype="float32", extra=["--quick"],
                    what="dry run: tiny model a (Qwen2 h64, 2 layers, vocab 512), float32 on the CPU, 1 epoch of 8 "
                         "new tokens, no checkpoints")
    else:
        spec = dict(models="d", device="cuda", dtype="bfloat16",
                    extra=["--epochs", str(args.bench_epochs), "--mixed-precision", "bf16"],
                    what=f"model d: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads), random init, weights "
                         f"in bf16 on the GPU (and ours once more with mixed_precision='bf16': float32 masters, "
                         f"bf16 compute); {args.bench_epochs} timed epochs of the seed workload (2 agents, 4 "
                         f"prompts x 4 completions of up to 64 tokens), no checkpoints")
    cmd = [python, "benchmarks/throughput.py", "--models", spec["models"], "--device", spec["device"],
           "--dtype", spec["dtype"], "--no-checkpoint", "--json", str(result_json), *spec["extra"]]
    for key, flag in (("comlrl", "--comlrl-python"), ("trl", "--trl-python")):
        if peers.get(key):
            cmd += [flag, peers[key]]
    code, output = sh(cmd, timeout=args.bench_timeout, log=workdir / "throughput.log")
    section = {"key": "throughput", "title": BENCH_TITLE, "what": spec["what"], "command": " ".join(cmd[1:]), "runs": {}, "speedups": {}}
    if code != 0 or not result_json.is_file():
        tail = " | ".join(output.strip().splitlines()[-4:])
        section.update(status="failed", note=f"exit {code}: {tail} (log: {workdir / 'throughput.log'})")
        return section
    entry = next(iter(json.loads(result_json.read_text()).values()))
    section["model"] = entry["model"]
    runs = entry["runs"]
    mixed = [("ours-mixed", MIXED_RUN)] if MIXED_RUN in runs else []
    for key, name in [("ours", "comlrl (this tree)")] + mixed + [(k, v) for k, v in PEER_NAMES.items()]:
        r = runs.get(name)
        if r is None:
            reason = "dry run installs no peers (pass --comlrl-python / --trl-python to use existing venvs)" \
                if args.dry_run else f"no interpreter with {name.split(' (')[0]} (its install failed or was skipped)"
            section["runs"][name] = {"status": f"skipped: {reason}"}
        elif "error" in r:
            section["runs"][name] = {"status": "failed", "detail": r["error"].strip().splitlines()[-1][:300]}
        else:
            section["runs"][name] = {"status": "passed", **{k: r.get(k) for k in (
                "seconds_per_epoch", "env_steps_per_s", "generated_tokens_per_s", "peak_rss_mb", "peak_gpu_mb",
                "phase_seconds_per_epoch", "device", "dtype")}}
    ours = section["runs"]["comlrl (this tree)"]
    for name, r in section["runs"].items():
        if name.startswith("comlrl (this") or r["status"] != "passed" or ours["status"] != "passed":
            continue
        factor = 2 if name.startswith("TRL") else 1  # TRL trains one policy: two agents are twice its work
        section["speedups"][name] = factor * r["seconds_per_epoch"] / ours["seconds_per_epoch"]
        mine = section["runs"].get(MIXED_RUN, {})
        if mine.get("status") == "passed":  # the lead of our mixed precision over each peer's bf16
            section.setdefault("speedups_mixed", {})[name] = factor * r["seconds_per_epoch"] / mine["seconds_per_epoch"]
    statuses = {r["status"] for r in section["runs"].values()}
    section["status"] = "failed" if "failed" in statuses else "passed" if statuses == {"passed"} else \
        "passed (some skipped)"
    return section


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (e.g. "9.0f"), or "n/a" right-aligned to the same width."""
    width = int(spec.split(".")[0] or 0)
    return "n/a".rjust(width) if value is None else format(value, spec)


def render(report: dict) -> str:
    lines = [f"==== comlrl GPU check: {report['mode_line']} ====",
             f"date {report['date']}   host {report['host']}   commit {report['commit']}"]
    env = report["environment"]
    lines.append("\n[environment]")
    if env.get("nvidia_smi"):
        lines.append(f"  nvidia-smi: {env['nvidia_smi']}")
    for role, info in env["interpreters"].items():
        if "error" in info:
            lines.append(f"  {role:<8} {info['python']}: cannot run it: {info['error']}")
            continue
        gpu = ", ".join(info.get("gpus") or []) or "no CUDA"
        extra = f", NCCL {info['nccl']}" if info.get("nccl") else ""
        lines.append(f"  {role:<8} {info['python']} (Python {info['python_version']}): torch {info.get('torch')} "
                     f"(CUDA {info.get('torch_cuda') or 'none'}{extra}); {gpu}")
        packages = ", ".join(f"{k} {info[k]}" for k in ("transformers", "comlrl", "vllm", "trl", "peft") if info.get(k))
        lines.append(f"  {'':<8} {packages}")
    lines.append("\n[setup]")
    for step in report["setup"] or [{"name": "environment", "status": "not recorded", "detail": ""}]:
        lines.append(f"  {step['name']:<14} {step['status']}" + (f": {step['detail']}" if step.get("detail") else ""))
    for number, section in enumerate(report["sections"], 1):
        lines.append(f"\n[{number}] {section['title']}")
        lines.append(f"    {section['status']}")
        if section.get("note"):
            lines.append(f"    note: {section['note']}")
        if section["key"] == "throughput":
            lines.extend(render_bench(section))
            continue
        if section["status"].startswith("skipped"):
            if section["items"]:
                lines.append(f"    ({len(section['items'])} test(s))")
            continue
        for case in section["items"]:
            word = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}[case["status"]]
            detail = f" ({case['seconds']:.1f} s)" if case["status"] == "passed" else f": {case['detail']}"
            lines.append(f"    {word}  {case['name']}{detail}")
    s = report["summary"]
    lines.append(f"\ngpu_check: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
    lines.append(f"(report: {report['report_path']}; JSON beside it; logs in {report['workdir']})")
    return "\n".join(lines) + "\n"


def render_bench(section: dict) -> list[str]:
    lines = [f"    {section['what']}"] if section.get("what") else []
    if section.get("model"):
        lines.append(f"    model: {section['model']}")
    if not section.get("runs"):
        return lines
    lines.append(f"    {'framework':<22} {'s/epoch':>8} {'env_steps/s':>11} {'tokens/s':>9} {'peak GPU MB':>11} "
                 f"{'peak RSS MB':>11}  speedup of ours")
    for name, r in section["runs"].items():
        if r["status"] != "passed":
            lines.append(f"    {name:<22} {r['status']}" + (f": {r['detail']}" if r.get("detail") else ""))
            continue
        speedup = section["speedups"].get(name)
        note = "" if speedup is None else f"{speedup:5.2f}x" + (" (vs 2 x its 1-policy time)" if name.startswith("TRL")
                                                              else "")
        lines.append(f"    {name:<22} {r['seconds_per_epoch']:8.3f} {r['env_steps_per_s']:11.1f} "
                     f"{fmt(r.get('generated_tokens_per_s'), '9.0f')} {fmt(r.get('peak_gpu_mb'), '11.0f')} "
                     f"{fmt(r.get('peak_rss_mb'), '11.0f')}  {note}")
    for name, speedup in section.get("speedups_mixed", {}).items():
        lines.append(f"    ours with mixed_precision='bf16' vs {name}: {speedup:5.2f}x")
    ours = section["runs"].get("comlrl (this tree)", {})
    if ours.get("phase_seconds_per_epoch"):
        lines.append("    ours per phase (s/epoch): " + ", ".join(
            f"{k} {v:.3f}" for k, v in ours["phase_seconds_per_epoch"].items()))
    return lines


def summarize(sections: list[dict]) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for section in sections:
        if section["key"] == "throughput":
            for r in section.get("runs", {}).values():
                counts["passed" if r["status"] == "passed" else "failed" if r["status"] == "failed" else "skipped"] += 1
            if not section.get("runs"):
                counts["failed" if section["status"] == "failed" else "skipped"] += 1
            continue
        if section["items"]:
            for case in section["items"]:
                counts[case["status"]] += 1
        elif section["status"] == "failed":
            counts["failed"] += 1
        elif section["status"].startswith("skipped"):
            counts["skipped"] += 1
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: CUDA steps skipped, tiny model, nothing installed")
    p.add_argument("--report", required=True, help="the text report's path (REPORT.json is written beside it)")
    p.add_argument("--workdir", default=None, help="logs and junit files (default: a temporary folder)")
    p.add_argument("--setup", default=None, help="JSON lines written by gpu_check.sh: one install step each")
    p.add_argument("--vllm-python", default=None, help="interpreter with comlrl and the real vLLM")
    p.add_argument("--comlrl-python", default=None, help="interpreter of a venv with comlrl==1.4.3 (peer)")
    p.add_argument("--trl-python", default=None, help="interpreter of a venv with trl==1.16.0 (peer)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out: tests, vllm, bench")
    p.add_argument("--bench-epochs", type=int, default=2, help="timed epochs per benchmark run (default 2)")
    p.add_argument("--tests-timeout", type=float, default=900, help="seconds for each pytest run")
    p.add_argument("--bench-timeout", type=float, default=1500, help="seconds for the benchmark (all its runs)")
    args = p.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - {"tests", "vllm", "bench"}
    if bad:
        p.error(f"--skip: unknown step(s) {sorted(bad)}; choose from tests, vllm, bench")
    report_path = Path(args.report).resolve()
    report_path.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="comlrl-gpu-check-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    interpreters = {"main": sys.executable}
    if args.vllm_python:
        interpreters["vllm"] = args.vllm_python
    if args.comlrl_python:
        interpreters["comlrl"] = args.comlrl_python
    if args.trl_python:
        interpreters["trl"] = args.trl_python
    env = {"interpreters": {role: probe(py) for role, py in interpreters.items()}, "nvidia_smi": nvidia_smi()}
    main_info = env["interpreters"]["main"]
    cuda = bool(main_info.get("cuda_available"))
    setup = []
    if args.setup and Path(args.setup).is_file():
        setup = [json.loads(line) for line in Path(args.setup).read_text().splitlines() if line.strip()]

    sections: list[dict] = []
    group_keys = [key for key, _, _ in GROUPS if key != "vllm"]
    if "tests" in skip:
        for key, title, _ in GROUPS[:-1]:
            sections.append(group_section(key, title, [], skipped="--skip tests"))
    else:
        cases, note = run_pytest(sys.executable, "not vllm", workdir, "cuda", args.tests_timeout)
        by_group = split_groups(cases, group_keys)
        for key, title, _ in GROUPS[:-1]:
            sections.append(group_section(key, title, by_group[key], note=note if not cases else ""))
        if by_group["other"]:
            sections.append(group_section("other", "other CUDA tests", by_group["other"]))
    vllm_title = GROUPS[-1][1]
    if "vllm" in skip:
        sections.append(group_section("vllm", vllm_title, [], skipped="--skip vllm"))
    else:
        python = args.vllm_python or sys.executable
        cases, note = run_pytest(python, "vllm", workdir, "vllm", args.tests_timeout)
        section = group_section("vllm", vllm_title, cases, note=note if not cases else "")
        if not args.vllm_python and not args.dry_run and cases and section["status"].startswith("skipped"):
            section["note"] = "no interpreter with vLLM: its install failed or was skipped (see [setup])"
        sections.append(section)
    if "bench" in skip or not (cuda or args.dry_run):
        sections.append({"key": "throughput", "title": BENCH_TITLE, "what": "", "runs": {}, "speedups": {},
                         "status": "skipped: --skip bench" if "bench" in skip else "skipped: no CUDA"})
    else:
        peers = {"comlrl": args.comlrl_python, "trl": args.trl_python}
        sections.append(run_bench(sys.executable, args, workdir, peers))

    gpus = main_info.get("gpus") or []
    if args.dry_run:
        mode_line = "DRY RUN on " + ("a CUDA machine" if cuda else "the CPU") + \
            " (CUDA-only steps skipped without CUDA, tiny model, nothing installed)"
    else:
        mode_line = (f"{len(gpus)} x {gpus[0]}" if gpus else "no CUDA device found")
    report = {
        "mode": "dry-run" if args.dry_run else "gpu", "mode_line": mode_line,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
        "commit": git_commit(), "environment": env, "setup": setup, "sections": sections,
        "summary": summarize(sections), "report_path": str(report_path), "workdir": str(workdir),
        "seconds": None,
    }
    report["seconds"] = round(time.time() - started, 1)
    text = render(report) + f"(took {report['seconds']:.0f} s)\n"
    report_path.write_text(text)
    report_path.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(text, end="")
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
