"""One epoch of the code-collaboration task, ours (the reward in comlrl.sandbox) beside comlrl 1.4.3
(the reward exec()'d in its own process under signal.alarm, as CoMLRL's task repositories run it),
each phase timed: rollout, reward, update (issue 28).

    python benchmarks/code_epoch.py [--train-size 64] [--runs 1] [--comlrl-python /tmp/venv-comlrl143/bin/python]

The workload is examples/code_collab.py's as it was when this benchmark was written (the example now
samples K = 8 with 8 rows per buffer and lr 2e-4): the small code model (comlrl.testing.code_model_dir(),
the directory scripts/build_code_model.py builds; a 400k-parameter Qwen2), two agents (agent 1 writes
``aux``, agent 2 the entry point, prompts from helper_formatter / main_formatter), the first
``--train-size`` train rows of comlrl.tasks.code.generated_split(), K = 4 joint answers per row, 1 turn,
48 new tokens, temperature 0.6 / top_p 0.6 / top_k 50, learning rate 1e-4, rollout buffer = train batch
= 2 rows, advantage normalisation on, no evaluation, no checkpoint. Each side runs in its own process,
one after the other:

  ours    MAGRPOTrainer + code_collab_reward(Sandbox(timeout_s=5)): each call checks one row's 4 joint
          programs in one Sandbox.check_many, every test on its own, in worker processes with every
          isolation layer the machine allows. Phases are the trainer's own timing/* of metrics.jsonl:
          rollout = timing/rollout, reward = timing/score (building the joint answers + the reward
          calls; the reward calls alone are also timed), update = the rest of train() (timing/update,
          timing/advantage, logging). The sandbox's workers are started before the timed epoch (a
          once-per-run cost, printed on its own line).
  1.4.3   its MAGRPOTrainer (benchmarks/peers/comlrl143_code.py) with the exec + alarm reward written
          for this benchmark (that file's docstring: the same reward levels, no isolation at all),
          called once per joint answer as 1.4.3 calls rewards. Phases measured from outside its
          package: rollout = its _generate_completions, reward = the reward calls, update = the rest.

The same model files, rows, prompt text and sampling settings on both sides. What differs: ours samples
with its lean decoder (both agents stacked, all K of a buffer's rows in one batch), 1.4.3 with
transformers' generate per agent and row, so the completions (and with them the programs the reward
runs and the rewards) differ in content though not in number; the mean reward of each side is printed
to show the reward phases judged comparable programs. 1.4.3 has no gradient clipping, so neither side
clips (the example clips at 1.0 on ours). Wall-clock time; the machine's load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
from common import emit, parser as runner_parser, peak_rss_mb, run_json_child, setup  # noqa: E402

SETTINGS = dict(num_generations=4, max_new_tokens=48, temperature=0.6, top_p=0.6, top_k=50, lr=1e-4,
                rollout_buffer_size=2, seed=0)


def runner_args(args, model_dir: Path, rows_json: Path) -> list[str]:
    s = SETTINGS
    return ["--model-dir", str(model_dir), "--rows-json", str(rows_json), "--epochs", "1",
            "--num-generations", str(s["num_generations"]), "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", str(s["temperature"]), "--top-p", str(s["top_p"]), "--top-k", str(s["top_k"]),
            "--lr", str(s["lr"]), "--rollout-buffer-size", str(s["rollout_buffer_size"]),
            "--advantage-normalization", "--seed", str(s["seed"]), "--threads", str(args.threads),
            "--test-timeout", str(args.test_timeout)]


# ------------------------------------------------------------------------------------------------
# ours, in a process of its own
# ------------------------------------------------------------------------------------------------
def run_ours(argv: list[str]) -> None:
    p = runner_parser("ours: one epoch of the code task")
    p.add_argument("--rows-json", required=True)
    p.add_argument("--test-timeout", type=int, default=5)
    p.add_argument("--sandbox-workers", type=int, default=None)
    args = p.parse_args(argv)
    setup(args)
    os.environ["COMLRL_DISABLE_PROGRESS"] = "1"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.sandbox import Sandbox
    from comlrl.tasks.code import CodeCollabReward, CollabLevels, helper_formatter, main_formatter
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    class TimedReward(CodeCollabReward):
        """code_collab_reward, its calls timed (a cross-check of timing/score)."""

        def __call__(self, completions1, completions2, *, batch_items=None):
            start = time.perf_counter()
            out = super().__call__(completions1, completions2, batch_items=batch_items)
            CALLS["seconds"] += time.perf_counter() - start
            CALLS["calls"] += 1
            return out

    CALLS = {"seconds": 0.0, "calls": 0}
    rows = json.loads(Path(args.rows_json).read_text())
    for row in rows:  # the prompts the peer is given are ours: check they are what the formatters write
        assert row["_prompts"] == [helper_formatter(row), main_formatter(row)]
    with tempfile.TemporaryDirectory() as tmp, Sandbox(timeout_s=args.test_timeout,
                                                       workers=args.sandbox_workers) as sandbox:
        start = time.perf_counter()
        sandbox.run_many(["pass"] * sandbox.workers)  # start the workers outside the epoch
        sandbox_start = time.perf_counter() - start
        reward = TimedReward(sandbox, CollabLevels(), "aux")  # what code_collab_reward(sandbox) builds, timed
        trainer = MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(args.model_dir) for _ in range(2)],
            tokenizer=AutoTokenizer.from_pretrained(args.model_dir),
            formatters=[helper_formatter, main_formatter], reward_func=reward,
            train_dataset=Dataset.from_list([{k: v for k, v in r.items() if k != "_prompts"} for r in rows]),
            args=MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=args.num_generations,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, agent_learning_rate=args.lr,
                              rollout_buffer_size=args.rollout_buffer_size,
                              train_batch_size=args.train_batch_size or args.rollout_buffer_size,
                              advantage_normalization=args.advantage_normalization, max_grad_norm=None,
                              logging_steps=1, eval_interval=0, early_termination_threshold=None,
                              seed=args.seed, output_dir=tmp))
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        layers = sandbox.isolation()
        trainer.close()
    timing: dict[str, float] = {}
    for row in metrics:
        for key, value in row.items():
            if key.startswith("timing/"):
                timing[key[7:]] = timing.get(key[7:], 0.0) + value
    for key, value in trainer.state.window.sums.items():  # anything not yet logged when train() returned
        if key.startswith("timing/"):
            timing[key[7:]] = timing.get(key[7:], 0.0) + value
    rollout, score = timing.get("rollout", 0.0), timing.get("score", 0.0)
    rewards = [row["train/reward_mean"] for row in metrics if "train/reward_mean" in row]
    emit({
        "framework": "comlrl (this tree)", "epochs": 1, "elapsed_s": elapsed, "seconds_per_epoch": elapsed,
        "rows": len(rows), "env_steps": metrics[-1]["env_step"], "env_steps_per_s": metrics[-1]["env_step"] / elapsed,
        "phase_seconds_per_epoch": {"rollout": rollout, "reward": score, "update": elapsed - rollout - score},
        "timing": timing, "reward_call_s": CALLS["seconds"], "reward_calls": CALLS["calls"],
        "reward_mean": sum(rewards) / max(len(rewards), 1), "sandbox_start_s": sandbox_start,
        "sandbox_workers": sandbox.workers, "sandbox_layers_on": sum(layers.values()),
        "sandbox_layers": len(layers), "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": None,
    })


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def run_child(cmd: list[str], timeout: float, peer: bool) -> dict:
    return run_json_child(cmd, timeout, own_packages=peer, cwd=str(HERE.parent))


def table(runs: dict[str, dict]) -> None:
    print(f"\n{'':<22} {'s/epoch':>8} {'rollout':>8} {'reward':>8} {'update':>8} {'reward share':>13} "
          f"{'mean reward':>12} {'peak RSS':>9}  (RSS: the trainer process; not the sandbox workers)")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<22} FAILED: {r['error']}")
            continue
        ph = r["phase_seconds_per_epoch"]
        print(f"{name:<22} {r['seconds_per_epoch']:8.2f} {ph['rollout']:8.2f} {ph['reward']:8.2f} {ph['update']:8.2f} "
              f"{ph['reward'] / r['seconds_per_epoch']:12.1%} {r['reward_mean']:12.3f} {r['peak_rss_mb']:6.0f} MB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_ours(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--train-size", type=int, default=64,
                   help="train rows in the epoch (default 64, examples/code_collab.py's)")
    p.add_argument("--max-new-tokens", type=int, default=SETTINGS["max_new_tokens"])
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    p.add_argument("--test-timeout", type=int, default=5, help="seconds per check: the sandbox's timeout_s, the "
                   "peer's signal.alarm (default 5, examples/code_collab.py's sandbox)")
    p.add_argument("--sandbox-workers", type=int, default=None, help="default: the sandbox's (CPU count, at most 8)")
    p.add_argument("--runs", type=int, default=1, help="epochs per side, alternating ours / 1.4.3 (best kept)")
    p.add_argument("--comlrl-python", default=None, help="python of a venv with comlrl==1.4.3 (the peer)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("--json", default=None, help="also write every run's result to this JSON file")
    args = p.parse_args()
    from comlrl.tasks.code import generated_split, helper_formatter, main_formatter
    from comlrl.testing import code_model_dir

    model = code_model_dir(log_every=50)
    train, _ = generated_split()
    rows = [dict(r) for r in train.select(range(min(args.train_size, len(train))))]
    for row in rows:
        row["_prompts"] = [helper_formatter(row), main_formatter(row)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=str(HERE)).stdout.strip()
    s = SETTINGS
    print(f"code task, one epoch: {len(rows)} train rows of generated_split(), model {model}, 2 agents (aux, main), "
          f"K={s['num_generations']}, {args.max_new_tokens} new tokens, temperature {s['temperature']} / top_p "
          f"{s['top_p']} / top_k {s['top_k']}, lr {s['lr']:g}, buffer = batch = {s['rollout_buffer_size']} rows, "
          f"{args.threads} torch thread(s), check timeout {args.test_timeout} s; commit {commit}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {"comlrl (this tree)": []}
    if args.comlrl_python:
        results["comlrl 1.4.3"] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows_json = Path(tmp) / "rows.json"
        rows_json.write_text(json.dumps(rows))
        common = runner_args(args, model, rows_json)
        ours_cmd = [sys.executable, str(HERE / "code_epoch.py"), "--worker", *common]
        if args.sandbox_workers:
            ours_cmd += ["--sandbox-workers", str(args.sandbox_workers)]
        for run in range(args.runs):
            for name in results:
                peer = name != "comlrl (this tree)"
                cmd = [args.comlrl_python, str(PEERS / "comlrl143_code.py"), *common] if peer else ours_cmd
                r = run_child(cmd, args.timeout, peer)
                results[name].append(r)
                extra = ""
                if "error" not in r:
                    if peer:
                        t = r["tests"]
                        extra = (f"generate {r['generate_s']:.2f} s of the rollout; {r['reward_calls']} reward calls; "
                                 f"{t['passed']}/{t['tests']} tests passed, {t['timeouts']} timeouts")
                    else:
                        extra = (f"reward calls alone {r['reward_call_s']:.2f} s ({r['reward_calls']} calls); "
                                 f"timing/* " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["timing"].items()))
                                 + f"; sandbox start {r['sandbox_start_s'] * 1000:.0f} ms ({r['sandbox_workers']} "
                                 f"workers, {r['sandbox_layers_on']}/{r['sandbox_layers']} isolation layers on)")
                print(f"  run {run + 1} {name}: " + (f"{r['seconds_per_epoch']:.2f} s/epoch; {extra}"
                                                     if "error" not in r else f"FAILED: {r['error']}"), flush=True)
    best = {}
    for name, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        best[name] = min(ok, key=lambda r: r["seconds_per_epoch"]) if ok else rs[-1]
    table(best)
    ours, theirs = best.get("comlrl (this tree)"), best.get("comlrl 1.4.3")
    if ours and theirs and "error" not in ours and "error" not in theirs:
        a, b = ours["seconds_per_epoch"], theirs["seconds_per_epoch"]
        ra, rb = ours["phase_seconds_per_epoch"]["reward"], theirs["phase_seconds_per_epoch"]["reward"]
        started = a + ours["sandbox_start_s"]
        print(f"\ngoal (ours, sandboxed, <= 1.4.3's unsandboxed epoch): {'met' if a <= b else 'missed'}: {a:.2f} s "
              f"against {b:.2f} s ({b / a:.2f}x); counting the sandbox's start-up, {started:.2f} s: "
              f"{'met' if started <= b else 'missed'}")
        print(f"reward phase: ours {ra:.2f} s ({ra / a:.1%} of its epoch), 1.4.3 {rb:.2f} s ({rb / b:.1%} of its "
              f"epoch): the sandbox costs {ra - rb:.2f} s/epoch more than exec + alarm")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
