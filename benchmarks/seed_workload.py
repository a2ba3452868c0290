"""The seed workload: 2 agents, 4 prompts, num_generations 4, 64 new tokens, 1 turn.

    python benchmarks/seed_workload.py [--hidden 64 --layers 2] [--epochs 3]

Prints seconds per epoch of train(), env_steps/s, generated tokens/s, time per phase and peak
memory (max RSS of this process).
"""

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from peers.common import PROMPTS, reward  # noqa: E402  (benchmarks/ is on sys.path: scripts run from here)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train-batch-size", type=int, default=1)
    parser.add_argument("--num-turns", type=int, default=1)
    parser.add_argument("--joint-mode", default="aligned", choices=["aligned", "cross"])
    args = parser.parse_args()
    path = tiny_model_dir(hidden_size=args.hidden, num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
            tokenizer=AutoTokenizer.from_pretrained(path), reward_func=reward,
            train_dataset=[{"prompt": p} for p in PROMPTS],
            args=MAGRPOConfig(num_train_epochs=args.epochs, num_generations=4,
                              max_new_tokens=args.max_new_tokens, logging_steps=1,
                              rollout_buffer_size=args.train_batch_size, num_turns=args.num_turns,
                              early_termination_threshold=None, joint_mode=args.joint_mode, output_dir=tmp),
            external_transition=(lambda prompt, agent_completions: [f"{prompt} {c[:40]}" for c in agent_completions])
            if args.num_turns > 1 else None,
        )
        start = time.perf_counter()
        trainer.train(checkpoint_dir=Path(tmp) / "ckpt", checkpoint_interval=1)
        elapsed = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(tmp) / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    phases = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("timing/"):
                phases[key[7:]] = phases.get(key[7:], 0.0) + value
    from comlrl.functional import tree_size

    nodes, joint = tree_size(args.num_turns, trainer._joint_per_node())
    rows_per_step = args.train_batch_size * nodes * 4
    tokens = sum(row[f"train/agent_{a}/completion_length"] * rows_per_step for row in rows for a in range(2))
    env_steps = rows[-1]["env_step"]
    print(f"seed workload: 2 x Qwen2 hidden {args.hidden}, {args.layers} layers, vocab 512; "
          f"{len(PROMPTS)} prompts x 4 generations, {args.max_new_tokens} new tokens, "
          f"train_batch_size {args.train_batch_size}, {args.epochs} epochs, num_turns {args.num_turns}, "
          f"joint_mode {args.joint_mode} ({nodes} nodes, {joint} joint actions per prompt)")
    print(f"seconds per epoch: {elapsed / args.epochs:.3f}    seconds per optimizer step: "
          f"{elapsed / rows[-1]['global_step']:.3f}")
    print(f"env_steps/s: {env_steps / elapsed:.1f}    generated tokens/s: {tokens / elapsed:.0f}")
    print("time per phase (s/epoch): " + ", ".join(f"{k} {v / args.epochs:.3f}" for k, v in sorted(phases.items())))
    print(f"peak memory (max RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
