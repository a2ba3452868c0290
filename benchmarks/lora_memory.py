"""Training memory of N full agents against N LoRA agents on one shared base (comlrl.adapters).

    python benchmarks/lora_memory.py [--hidden 256 --layers 4] [--rank 8] [--json results.json]

Model: the tiny Qwen2 of ``tiny_model_dir(hidden_size=256, num_layers=4)`` (vocab 512, fp32).
Setups: 1, 2 and 4 full agents (separate copies, AdamW on all weights) and 1, 2 and 4 LoRA agents
(``build_lora_agents``: r=8, alpha 16, every linear layer but the output head, AdamW on the adapter).

Each setup runs in a fresh process that imports everything, notes its RSS, builds the agents, then per
agent does one forward/backward/AdamW step over a seed-workload-like batch (4 seed prompts x 4
generations = 16 rows, the prompt left-padded + 64 completion tokens, the masked policy-gradient loss
through ``comlrl.functional.sequence_log_probs``). It reports

  (a) the exact bytes of the unique tensor storages held for training after the step: parameters
      (the shared base counted once), gradients and AdamW state (exp_avg, exp_avg_sq, step);
  (b) the peak RSS increase of that process (VmHWM) over its RSS just after the imports, which also
      covers activations, the autograd graph and allocator overhead.

(b) is measured twice: with glibc malloc as it comes, and with a fixed mmap threshold of 128 KiB
(``MALLOC_MMAP_THRESHOLD_=131072``). By default glibc raises its mmap threshold after the first large
free, so later activation buffers come from the heap and freed ones stay resident: RSS then grows
with every forward/backward whatever the model holds (on this tiny model activations are ~10x the
weights). With the fixed threshold every tensor of 128 KiB or more is returned to the system when
freed, and RSS follows the live tensors.

Everything is printed as a markdown table with the ratio to one full agent, then whether
"4 LoRA agents < 1.3x one full agent" holds for each measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from comlrl.testing import SEED_PROMPTS

SETUPS = [("full", 1), ("full", 2), ("full", 4), ("lora", 1), ("lora", 2), ("lora", 4)]
MALLOC = {"rss_default": {}, "rss_mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
GENERATIONS = 4
COMPLETION_TOKENS = 64


def _status_kb(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS: now, VmHWM: peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


# ------------------------------------------------------------------------------------------------
# one setup, in its own process
# ------------------------------------------------------------------------------------------------

def run_worker(kind: str, num_agents: int, model_dir: str, rank: int) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.adapters import build_lora_agents
    from comlrl.functional import policy_gradient_loss, sequence_log_probs
    from comlrl.rollout import left_pad

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenizer(SEED_PROMPTS)["input_ids"]
    prompt_ids, prompt_mask = left_pad([ids for ids in encoded for _ in range(GENERATIONS)], tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    rows = prompt_ids.shape[0]
    completion_ids = torch.randint(1, len(tokenizer), (rows, COMPLETION_TOKENS), generator=gen)
    mask = torch.ones_like(completion_ids, dtype=torch.bool)
    advantages = torch.randn(rows, generator=gen)
    baseline_kb = _status_kb("VmRSS")  # after imports and the (tiny) batch

    if kind == "full":
        agents = [AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(num_agents)]
    else:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
        torch.manual_seed(0)
        agents = build_lora_agents(AutoModelForCausalLM.from_pretrained(model_dir), config, num_agents)
    optimizers = [torch.optim.AdamW([p for p in a.parameters() if p.requires_grad], lr=1e-5) for a in agents]
    for agent, optimizer in zip(agents, optimizers):
        agent.train()
        logp = sequence_log_probs(agent, prompt_ids, prompt_mask, completion_ids)
        policy_gradient_loss(logp, advantages, mask).backward()
        optimizer.step()

    seen: set[int] = set()

    def unique_bytes(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    models = [agents[0].shared] if kind == "lora" else agents
    params = [p for m in models for p in m.parameters()]
    weights = unique_bytes(params)
    grads = unique_bytes(p.grad for p in params if p.grad is not None)
    adam = unique_bytes(v for o in optimizers for s in o.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
    trainable = sum(p.numel() for o in optimizers for g in o.param_groups for p in g["params"])
    return dict(kind=kind, agents=num_agents, weights=weights, grads=grads, adam=adam,
                storage=weights + grads + adam, trainable_parameters=trainable,
                prompt_tokens=prompt_ids.shape[1], rss_increase=(_status_kb("VmHWM") - baseline_kb) * 1024,
                baseline_rss=baseline_kb * 1024)


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "kind:N" (internal)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, count = args.worker.split(":")
        print(json.dumps(run_worker(kind, int(count), args.model_dir, args.rank)))
        return

    from comlrl.testing import tiny_model_dir

    model_dir = str(tiny_model_dir(hidden_size=args.hidden, num_layers=args.layers))  # built here, once
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    results = []
    for kind, count in SETUPS:
        runs = {}
        for mode, extra in MALLOC.items():
            done = subprocess.run([sys.executable, __file__, "--worker", f"{kind}:{count}", "--model-dir",
                                   model_dir, "--rank", str(args.rank)], capture_output=True, text=True,
                                  env={**env, **extra})
            if done.returncode != 0:
                raise SystemExit(f"{kind}:{count} ({mode}) failed:\n{done.stderr[-3000:]}")
            runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        record = runs["rss_default"]  # tensor bytes are the same in both runs
        record.update({mode: run["rss_increase"] for mode, run in runs.items()})
        del record["rss_increase"]
        results.append(record)
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: list[dict], args) -> None:
    one = next(r for r in results if r["kind"] == "full" and r["agents"] == 1)
    mb = 1 / 2**20
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab 512, fp32; LoRA r={args.rank}, alpha "
          f"{2 * args.rank}, all linear layers but lm_head; batch {len(SEED_PROMPTS) * GENERATIONS} rows x "
          f"({one['prompt_tokens']} prompt + {COMPLETION_TOKENS} completion) tokens; one AdamW step per agent\n")
    print("| setup | trainable params | weights MiB | grads MiB | AdamW MiB | (a) storage MiB | (a) ratio "
          "| (b) peak RSS increase MiB, default malloc | ratio | (b) peak RSS increase MiB, mmap 128 KiB | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        label = f"{r['agents']} {'full' if r['kind'] == 'full' else 'LoRA'} agent{'s' if r['agents'] > 1 else ''}"
        print(f"| {label} | {r['trainable_parameters']:,} | {r['weights'] * mb:.2f} | {r['grads'] * mb:.2f} "
              f"| {r['adam'] * mb:.2f} | {r['storage'] * mb:.2f} | {r['storage'] / one['storage']:.3f}x "
              + "".join(f"| {r[m] * mb:.1f} | {r[m] / one[m]:.3f}x " for m in MALLOC) + "|")
    four = next(r for r in results if r["kind"] == "lora" and r["agents"] == 4)
    for label, key in (("(a) tensor storage", "storage"), ("(b) peak RSS increase, default malloc", "rss_default"),
                       ("(b) peak RSS increase, mmap threshold 128 KiB", "rss_mmap")):
        ratio = four[key] / one[key]
        print(f"\n4 LoRA agents < 1.3x one full agent, {label}: {ratio:.3f}x -> "
              f"{'holds' if ratio < 1.3 else 'does NOT hold'}", end="")
    print()


if __name__ == "__main__":
    main()
