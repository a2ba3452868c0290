"""Reward call shape on the seed workload: one call per joint action (the default, CoMLRL 1.4.3's)
against one batched call per task item (``comlrl.utils.batched_reward``).

    python benchmarks/reward_call_shape.py [--runs 3] [--epochs 2] [--calls 2000]

Trains the seed workload (2 agents, 4 prompts, num_generations 4, 64 new tokens, 1 turn) with the
seed's reward in both call shapes, alternating, in one process (a fresh trainer per run from the
same saved model), and prints the median seconds per epoch and score-phase seconds per epoch of
each shape with their ratio, and what the per-joint-action calls add to the score phase (fastest
run of each, the least disturbed by other processes) as a share of an epoch. Then times the reward
path alone (``RewardFunction`` on one task item's 4 joint actions, averaged over ``--calls``) in
both shapes: the steadiest figure on a loaded machine.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.engine.rewards import RewardFunction  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from comlrl.utils import batched_reward  # noqa: E402
from peers.common import PROMPTS, reward  # noqa: E402  (benchmarks/ is on sys.path: scripts run from here)


def batched(completions1, completions2):
    return reward(completions1, completions2)


batched_reward(batched)
SHAPES = {"per joint action": reward, "batched": batched}


def train_once(path: Path, reward_func, epochs: int) -> tuple[float, float]:
    """(seconds per epoch of train(), score-phase seconds per epoch)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
            tokenizer=AutoTokenizer.from_pretrained(path), reward_func=reward_func,
            train_dataset=[{"prompt": p} for p in PROMPTS],
            args=MAGRPOConfig(num_train_epochs=epochs, num_generations=4, max_new_tokens=64, logging_steps=1,
                              num_turns=1, early_termination_threshold=None, output_dir=tmp))
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return elapsed / epochs, sum(row.get("timing/score", 0.0) for row in rows) / epochs


def reward_path(calls: int) -> dict[str, float]:
    """Microseconds per task item of the reward path alone (4 joint actions, 2 agents)."""
    completions = [["a short answer " * 2] * 4, ["a longer answer, about three times longer " * 2] * 4]
    out = {}
    for name, func in SHAPES.items():
        function = RewardFunction(func, 2)
        function(completions, "prompt", {"prompt": "prompt"})
        start = time.perf_counter()
        for _ in range(calls):
            function(completions, "prompt", {"prompt": "prompt"})
        out[name] = (time.perf_counter() - start) / calls * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per call shape (alternating)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000, help="task items timed in the reward-path measurement")
    args = parser.parse_args()
    path = tiny_model_dir()
    times = {name: [] for name in SHAPES}
    score = {name: [] for name in SHAPES}
    for _ in range(args.runs):
        for name, func in SHAPES.items():
            epoch, scored = train_once(path, func, args.epochs)
            times[name].append(epoch)
            score[name].append(scored)
    print(f"seed workload: 2 x Qwen2 hidden 64, 2 layers, vocab 512; {len(PROMPTS)} prompts x 4 generations, 64 new "
          f"tokens; {args.epochs} epochs per run, {args.runs} runs per call shape, alternating")
    for name in SHAPES:
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:>17}: {statistics.median(times[name]):.3f} s/epoch (runs {runs}); score phase "
              f"{min(score[name]) * 1e3:.2f} ms/epoch (fastest run; median {statistics.median(score[name]) * 1e3:.2f})")
    ratio = statistics.median(times["per joint action"]) / statistics.median(times["batched"])
    extra = min(score["per joint action"]) - min(score["batched"])
    print(f"per joint action / batched: {ratio:.3f} x the time per epoch (whole-epoch times include the machine's "
          f"noise); the score phase (fastest runs) costs {extra * 1e3:+.2f} ms/epoch more, "
          f"{100 * extra / min(times['batched']):+.3f}% of the fastest epoch")
    micro = reward_path(args.calls)
    print("reward path alone (RewardFunction, 4 joint actions of one task item): " +
          ", ".join(f"{name} {us:.1f} us" for name, us in micro.items()) +
          f"; per joint action / batched {micro['per joint action'] / micro['batched']:.2f} x")


if __name__ == "__main__":
    main()
