"""Two agents write code together on HumanEval: agent 1 a helper `aux`, agent 2 the entry-point
function that may call it; the code-collaboration reward runs the task's tests in comlrl.sandbox.

    python examples/code_collab.py                       # built-in tiny random model: a smoke run
    python examples/code_collab.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct --epochs 4 --turns 2

A random tiny model writes no working code, so its rewards stay near 0: the run shows the pipeline
(sampling, sandboxed tests, checkpoints, pass@k) end to end. With a real model the reward and
pass@1 rise. Needs the code extra: pip install -e ".[code]" in the checkout.
"""

import argparse
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.sandbox import Sandbox
from comlrl.tasks.code import (code_collab_reward, code_eval_logger, helper_formatter, humaneval_split,
                               main_formatter, pass_at_k_aggregator, repeat_rows, test_feedback_transition)
from comlrl.testing import tiny_model_dir
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or directory (default: the tiny random model)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--turns", type=int, default=1, help="2: the second turn sees the failing tests")
    parser.add_argument("--train-size", type=int, default=4, help="HumanEval problems to train on")
    parser.add_argument("--eval-size", type=int, default=4, help="problems for pass@k (4 samples each)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="checkpoints and metrics (default: a temporary folder)")
    args = parser.parse_args()
    model = args.model or str(tiny_model_dir())
    out = Path(args.out or tempfile.mkdtemp(prefix="code-collab-"))
    sandbox = Sandbox(timeout_s=5)
    print("sandbox layers off:", [k for k, v in sandbox.isolation().items() if not v] or "none")
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(model),
        formatters=[helper_formatter, main_formatter],
        reward_func=code_collab_reward(sandbox),
        external_transition=test_feedback_transition(sandbox) if args.turns > 1 else None,
        train_dataset=humaneval_split("train", limit=args.train_size),
        eval_dataset=repeat_rows(humaneval_split("eval", limit=args.eval_size), 4),
        eval_logger=code_eval_logger(sandbox), eval_aggregator=pass_at_k_aggregator(ks=(1, 4)),
        args=MAGRPOConfig(num_turns=args.turns, num_train_epochs=args.epochs, num_generations=4,
                          max_new_tokens=args.max_new_tokens or (32 if args.model is None else 256),
                          agent_learning_rate=1e-3 if args.model is None else 5e-6, logging_steps=1,
                          # pass@k once per epoch (before its first prompt) and after the run, below
                          eval_interval=args.train_size, eval_num_samples=0, early_termination_threshold=None,
                          output_dir=str(out)),
    )
    trainer.train(checkpoint_dir=out / "checkpoints", checkpoint_interval=1)
    print({k: round(v, 3) for k, v in trainer.evaluate().items() if "pass" in k or k == "eval/reward_mean"})
    print(f"checkpoints and metrics.jsonl in {out / 'checkpoints'}")
    trainer.close()
    sandbox.close()


if __name__ == "__main__":
    main()
