"""What every runner of the throughput benchmark shares: the seed workload's prompts and reward,
the command line, thread settings and the one JSON line printed at the end.

Plain Python (no comlrl import): the peer runners run in other virtual environments, one of
which has another package named ``comlrl`` installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys

PROMPTS = ["Describe a city in the clouds:", "Invent a new holiday and explain it:",
           "Write a bedtime story for a dragon:", "Design a playground on Mars:"]


def length_ratio(first: str, second: str) -> float:
    """The seed reward of one joint action: ``second`` should be 2-3x as long as ``first``."""
    ratio = len(second) / max(len(first), 1)
    return math.exp(-(0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))))


def reward(completions1, completions2):
    """The seed workload's two-agent reward (benchmarks/seed_workload.py)."""
    return [length_ratio(a, b) for a, b in zip(completions1, completions2)]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-dir", required=True, help="transformers model + tokenizer directory")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (OMP_NUM_THREADS too)")
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="save a checkpoint after every epoch (as the seed workload does)")
    p.add_argument("--prompts-json", default=None, help="JSON list of prompts (default: the 4 seed prompts)")
    p.add_argument("--trainer", default="magrpo", choices=TRAINERS,
                   help="magrpo; iac (a separate critic per agent, the same model); maac (one critic); madpo; "
                        "marlhf (its reward model: the same model)")
    p.add_argument("--device", default="cpu", help="where the models train: cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype the models are loaded in (weights, gradients and AdamW state); default float32")
    p.add_argument("--rollout-buffer-size", type=int, default=1, help="MAGRPO: prompts sampled before their updates")
    p.add_argument("--train-batch-size", type=int, default=None, help="MAGRPO: prompts per optimizer step "
                                                                       "(default: the buffer)")
    p.add_argument("--advantage-normalization", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--clock", default="wall", choices=CLOCKS,
                   help="what the timings read: wall-clock time (default) or this process's CPU time (every "
                        "thread's; steadier on a machine other jobs load)")
    return p


CLOCKS = ("wall", "cpu")


def clock(name: str):
    """The timer of ``--clock``: ``time.perf_counter`` (wall) or ``time.process_time`` (cpu)."""
    import time

    return time.process_time if name == "cpu" else time.perf_counter


DTYPES = ("float32", "bfloat16")


def model_dtype(args):
    """The ``torch.dtype`` of ``--dtype``."""
    import torch

    return getattr(torch, args.dtype)


def peak_gpu_mb():
    """Peak CUDA memory allocated by this process's tensors so far (MB), or None without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


TRAINERS = ("magrpo", "iac", "maac", "madpo", "marlhf")


def setup(args) -> list[str]:
    """Quiet, offline, ``args.threads`` threads; returns the prompts."""
    for key, value in (("OMP_NUM_THREADS", str(args.threads)), ("MKL_NUM_THREADS", str(args.threads)),
                       ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("WANDB_MODE", "disabled"),
                       ("TOKENIZERS_PARALLELISM", "false"), ("DISABLE_MLFLOW_INTEGRATION", "TRUE")):
        os.environ.setdefault(key, value)
    import torch

    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available in this environment (torch {torch.__version__})")
    return json.loads(args.prompts_json) if args.prompts_json else list(PROMPTS)


def peak_rss_mb() -> float:
    """Max resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(result: dict) -> None:
    """The runner's result: one JSON line, last on stdout."""
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


def run_json_child(cmd: list[str], timeout: float, own_packages: bool, cwd: str) -> dict:
    """Run one benchmark process and return the JSON line it ``emit``-ted (``{"error": ...}`` when it
    printed none). ``own_packages``: a peer in its own venv, which must not see this checkout's
    PYTHONPATH (another ``comlrl`` is among its packages)."""
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if own_packages:
        env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{") and '"seconds_per_epoch"' in line:
            return json.loads(line)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}:\n      " + "\n      ".join(tail)}
