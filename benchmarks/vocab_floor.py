"""The least time per epoch the seed workload can take on model c (Qwen2.5 vocabulary), on this machine.

    python benchmarks/vocab_floor.py [--comlrl143-seconds 13.6] [--threads 1]

Model c is a 2-layer hidden-64 Qwen2 with a 151,646-token vocabulary; its output matrix is
151,646 x 64 (39 MB in float32) and dwarfs everything else. Whatever the implementation, one epoch of
the seed workload (4 prompts, 2 agents, 4 generations, 16 new tokens, one optimizer step per prompt,
float32) has to do these products with it:

* rollout: one [4, 64] x [64, V] product per agent and sampled token (every row needs its full
  next-token distribution to sample from with top-k 50): 4 prompts x 16 tokens x 2 agents;
* update: per agent and prompt, the logits of the 4 x 16 completion tokens ([64, 64] x [64, V]),
  the gradient with respect to the hidden states ([64, V] x [V, 64]) and to the output matrix
  ([V, 64] x [64, 64]): 4 prompts x 2 agents x 3 products;
* the AdamW step over each agent's output matrix and embedding (2 x 151,646 x 64 parameters).

This script times exactly those operations with plain torch (outputs preallocated, so no page
faults are counted) and prints their sum: a floor no trainer can beat in float32 on this CPU. It also
prints what a given speed-up over comlrl 1.4.3 would require, for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

VOCAB, HIDDEN, ROWS, TOKENS, PROMPTS, AGENTS = 151_646, 64, 4, 16, 4, 2


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--comlrl143-seconds", type=float, default=None,
                        help="comlrl 1.4.3's s/epoch on model c from throughput.py, to print the 10x budget")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN) * 0.02
    embed = torch.randn(VOCAB, HIDDEN) * 0.02
    step_hidden = torch.randn(ROWS, HIDDEN)
    step_logits = torch.empty(ROWS, VOCAB)
    hidden = torch.randn(ROWS * TOKENS, HIDDEN)
    logits = torch.empty(ROWS * TOKENS, VOCAB)
    grad_logits = torch.randn(ROWS * TOKENS, VOCAB) * 1e-3
    grad_hidden = torch.empty(ROWS * TOKENS, HIDDEN)
    grad_head = torch.empty(VOCAB, HIDDEN)
    params = [head.clone(), embed.clone()]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    for p, g in zip(params, grads):
        p.grad = g

    decode = best_of(lambda: torch.mm(step_hidden, head.t(), out=step_logits), args.repeats)
    forward = best_of(lambda: torch.mm(hidden, head.t(), out=logits), args.repeats)
    backward_hidden = best_of(lambda: torch.mm(grad_logits, head, out=grad_hidden), args.repeats)
    backward_head = best_of(lambda: torch.mm(grad_logits.t(), hidden, out=grad_head), args.repeats)
    adamw = best_of(optimizer.step, args.repeats)

    rollout = PROMPTS * TOKENS * AGENTS * decode
    update = PROMPTS * AGENTS * (forward + backward_hidden + backward_head + adamw)
    print(f"model c products on this machine ({args.threads} thread(s), best of {args.repeats}):")
    print(f"  decode head [4,64]x[64,V]            {decode * 1e3:7.2f} ms  x {PROMPTS * TOKENS * AGENTS} per epoch")
    print(f"  update logits [64,64]x[64,V]         {forward * 1e3:7.2f} ms  x {PROMPTS * AGENTS}")
    print(f"  update grad hidden [64,V]x[V,64]     {backward_hidden * 1e3:7.2f} ms  x {PROMPTS * AGENTS}")
    print(f"  update grad head [V,64]x[64,64]      {backward_head * 1e3:7.2f} ms  x {PROMPTS * AGENTS}")
    print(f"  AdamW over head + embedding          {adamw * 1e3:7.2f} ms  x {PROMPTS * AGENTS}")
    print(f"floor: rollout {rollout:.3f} + update {update:.3f} = {rollout + update:.3f} s/epoch "
          "(nothing else counted: no softmax, sampling, layers, checkpoint)")
    if args.comlrl143_seconds:
        for factor in (5, 10):
            budget = args.comlrl143_seconds / factor
            print(f"{factor}x over comlrl 1.4.3 ({args.comlrl143_seconds:.2f} s/epoch) needs <= {budget:.3f} s/epoch: "
                  f"{'possible in principle' if budget > rollout + update else 'below the floor'}")


if __name__ == "__main__":
    main()
