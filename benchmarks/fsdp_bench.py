"""Per-process memory and step time of sharded agents (sharding="fsdp2") on 1 and 2 processes.

    python benchmarks/fsdp_bench.py [--hidden 512 --layers 8] [--epochs 2] [--device cpu]

Trains MAGRPO on the seed task with 2 agents of a random Qwen2 of the given width (vocabulary 512)
under `torchrun --nproc_per_node P` for P = 1 and 2, unsharded and sharded, and prints for each run
and process: the share of each agent's parameters and AdamW moments it holds, the bytes of those
(parameters + gradients + moments, measured from the tensors), the peak RSS of the process, and the
seconds per optimizer step (mean of the timed steps, the first step excluded). On CPU (gloo) the
time includes the collectives' copies, so it shows the cost of sharding, not a speed-up; the point is
the memory column. On GPUs pass --device cuda (NCCL; peak GPU memory is printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from comlrl.engine.sharding import local_fraction
    from comlrl.testing import SEED_PROMPTS, length_ratio_reward, tiny_model_dir

    torch.set_num_threads(1)
    path = tiny_model_dir(hidden_size=args.hidden, num_layers=args.layers)
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)], tokenizer=AutoTokenizer.from_pretrained(path),
        reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=MAGRPOConfig(num_turns=1, num_train_epochs=args.epochs, num_generations=4, max_new_tokens=16,
                          rollout_buffer_size=2, agent_learning_rate=1e-4, logging_steps=1, sharding=args.sharding,
                          agent_devices=args.device, output_dir=str(Path(args.out) / "out")))
    stamps = []  # when each optimizer step (every agent updated) ends
    original = trainer.optimizer_step

    def timed(*a, **k):
        result = original(*a, **k)
        stamps.append(time.perf_counter())
        return result

    trainer.optimizer_step = timed
    trainer.train()
    params = [p for m in trainer.agents for p in m.parameters()]
    moments = [v for o in trainer.optimizers for st in o.state.values() for k, v in st.items() if k.startswith("exp_avg")]

    def local_bytes(tensors):
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)

    steps = [b - a for a, b in zip(stamps, stamps[1:])][1:] or [float("nan")]
    record = {"rank": trainer.dist.rank, "world": max(trainer.dist.world_size, 1), "sharding": args.sharding,
              "params_fraction": round(local_fraction(params), 3), "moments_fraction": round(local_fraction(moments), 3),
              "state_mb": round((2 * local_bytes(params) + local_bytes(moments)) / 2**20, 1),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "s_per_step": round(sum(steps) / len(steps), 3)}
    if args.device == "cuda":
        record["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    # one file per process: their stdout lines would interleave
    (Path(args.out) / f"result-{record['rank']}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"model: 2 agents, Qwen2 hidden {args.hidden}, {args.layers} layers, vocab 512; device {args.device}")
    print(f"{'processes':>9} {'sharding':>8} {'rank':>4} {'params':>7} {'moments':>7} {'state MB':>9} "
          f"{'peak RSS MB':>11} {'s/step':>7}")
    for procs in (1, 2):
        for sharding in ("none", "fsdp2"):
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                           str(HERE), "--worker", "--sharding", sharding, "--out", out, "--hidden", str(args.hidden),
                           "--layers", str(args.layers), "--epochs", str(args.epochs), "--device", args.device]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                result = subprocess.run(command, capture_output=True, text=True, env=env)
                lines = [json.loads(f.read_text()) for f in sorted(Path(out).glob("result-*.json"))]
            if result.returncode or not lines:
                print(f"{procs:>9} {sharding:>8} failed: {result.stderr[-400:]}")
                continue
            for r in sorted(lines, key=lambda r: r["rank"]):
                print(f"{procs:>9} {sharding:>8} {r['rank']:>4} {r['params_fraction']:>7} {r['moments_fraction']:>7} "
                      f"{r['state_mb']:>9} {r['peak_rss_mb']:>11} {r['s_per_step']:>7}")


if __name__ == "__main__":
    main()
