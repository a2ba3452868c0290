"""Two agents write code together: agent 1 a helper `aux`, agent 2 the entry-point function that
calls it; the code-collaboration reward runs each joint program's unit tests in comlrl.sandbox.

    python examples/code_collab.py                                 # small code model, generated task
    python examples/code_collab.py --turns 2                       # turn 2 sees the failing tests
    python examples/code_collab.py --task humaneval --model Qwen/Qwen2.5-Coder-1.5B-Instruct --epochs 4

By default the agents are the small code model of comlrl.testing.code_model_dir() (a 400k-parameter
Qwen2 fine-tuned offline on the train split of the generated task, slips included: docs/code.md;
the package ships it) and the task is comlrl.tasks.code.generated_split(): two-step problems (a
helper's step, then the main function's) whose eval problems are compositions neither the
fine-tuning nor RL saw. RL trains on comlrl.testing.code_rl_problems() for 4 epochs, 40-80 s on
2 CPU cores; held-out pass@1 rises from about 0.12 to about 0.4 (docs/code.md has the seeds). The
run prints the sandbox's isolation, a progress bar, pass@1 on the eval problems at every
evaluation (the first before any training), a table and a plot, and writes metrics.jsonl (its eval
rows hold eval/turn_1/pass@1), final_eval.json (the evaluation after the last update) and
code_collab.png to --output-dir. Needs the code extra: pip install -e ".[code]"
in the checkout.
"""

import argparse
import json
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.sandbox import Sandbox
from comlrl.tasks.code import (code_collab_reward, code_eval_logger, generated_split, helper_formatter,
                               humaneval_split, main_formatter, pass_at_k_aggregator, repeat_rows,
                               test_feedback_transition)
from comlrl.testing import code_model_dir, code_rl_problems
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def task(name: str, train_size: int, eval_size: int):
    if name == "generated":
        # The rows RL trains on; the small model was fine-tuned on other rows (comlrl.testing.code_rl_problems).
        train, evals = code_rl_problems(count=train_size), generated_split()[1]
    else:
        train, evals = humaneval_split("train"), humaneval_split("eval")
    return train.select(range(min(train_size, len(train)))), evals.select(range(min(eval_size, len(evals))))


def print_isolation(sandbox: Sandbox) -> None:
    layers = sandbox.isolation()
    print(f"sandbox isolation ({sum(layers.values())}/{len(layers)} layers on):")
    for name, on in layers.items():
        print(f"  {'on ' if on else 'OFF'}  {name}")


def report(rows: list, turns: int, out: Path) -> None:
    """The eval rows as a table, and as a plot when matplotlib is installed."""
    evals = [r for r in rows if "eval/turn_1/pass@1" in r]
    head = f"{'env step':>8} {'epoch':>6} {'pass@1':>7}" + (f" {'turn-2 pass@1':>13}" if turns > 1 else "") + \
        f" {'reward':>7}"
    print(head)
    for r in evals:
        line = f"{r['env_step']:>8} {r['epoch']:>6.2f} {r['eval/turn_1/pass@1']:>7.3f}"
        if turns > 1:
            line += f" {r.get('eval/turn_2/pass@1', float('nan')):>13.3f}"
        print(line + f" {r['eval/turn_1/reward_mean']:>7.3f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["env_step"] for r in evals]
    for t in range(1, turns + 1):
        ax.plot(steps, [r.get(f"eval/turn_{t}/pass@1", float("nan")) for r in evals], marker="o",
                label=f"turn {t} pass@1")
    ax.set_xlabel("env step")
    ax.set_ylabel("held-out pass@1")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "code_collab.png", dpi=120)
    print(f"plot: {out / 'code_collab.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or directory (default: the small code model)")
    parser.add_argument("--task", choices=("generated", "humaneval"), default="generated")
    parser.add_argument("--epochs", type=int, default=None, help="default: 4 for the small model, 1 otherwise")
    parser.add_argument("--turns", type=int, default=1, help="2: the second turn sees the failing tests")
    parser.add_argument("--train-size", type=int, default=64, help="train problems")
    parser.add_argument("--eval-size", type=int, default=48, help="held-out problems for pass@1")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="answers sampled per held-out problem (default: 4 for the small model, 1 otherwise)")
    parser.add_argument("--eval-every", type=int, default=64, help="evaluate before every this many train problems")
    parser.add_argument("--lr", type=float, default=None, help="default: 2e-4 for the small model, 5e-6 otherwise")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--num-generations", type=int, default=None,
                        help="joint answers per problem and turn (the GRPO group); default 4, or 8 for the small "
                             "model in one turn (with --turns 2 each turn-1 answer gets this many turn-2 answers)")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="train problems sampled before each update (rollout_buffer_size; default: 8 for the small "
                             "model, 2 otherwise)")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (training and eval)")
    parser.add_argument("--top-p", type=float, default=0.6, help="nucleus sampling (training and eval)")
    parser.add_argument("--top-k", type=int, default=50, help="0: no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", "--out", dest="output_dir", default=None,
                        help="metrics.jsonl and the plot (default: a temporary folder)")
    args = parser.parse_args()
    small = args.model is None

    def given(value, default):
        return default if value is None else value

    epochs = given(args.epochs, 4 if small else 1)
    eval_samples = given(args.eval_samples, 4 if small else 1)
    if min(epochs, eval_samples) < 1:
        parser.error("--epochs and --eval-samples must be >= 1")
    model = args.model or str(code_model_dir(log_every=50))
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="code-collab-"))
    out.mkdir(parents=True, exist_ok=True)
    train, evals = task(args.task, args.train_size, args.eval_size)
    print(f"model: {model}\ntask: {args.task}, {len(train)} train and {len(evals)} held-out problems")
    with Sandbox(timeout_s=5) as sandbox:
        print_isolation(sandbox)
        trainer = MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(model) for _ in range(2)],
            tokenizer=AutoTokenizer.from_pretrained(model),
            formatters=[helper_formatter, main_formatter],
            reward_func=code_collab_reward(sandbox),
            external_transition=test_feedback_transition(sandbox) if args.turns > 1 else None,
            train_dataset=train, eval_dataset=repeat_rows(evals, eval_samples),
            eval_logger=code_eval_logger(sandbox), eval_aggregator=pass_at_k_aggregator(ks=(1,)),
            args=MAGRPOConfig(num_turns=args.turns, num_train_epochs=epochs,
                              num_generations=given(args.num_generations, 8 if small and args.turns == 1 else 4),
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_new_tokens=given(args.max_new_tokens, 48 if small else 256),
                              agent_learning_rate=given(args.lr, 2e-4 if small else 5e-6), max_grad_norm=1.0,
                              rollout_buffer_size=given(args.prompts_per_step, 8 if small else 2), logging_steps=1,
                              eval_interval=args.eval_every, eval_num_samples=0, eval_batch_size=16,
                              early_termination_threshold=None, seed=args.seed, output_dir=str(out)),
        )
        trainer.train()
        final = trainer.evaluate()  # after the last update (the cadence evaluates before prompts only)
        trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = {"env_step": rows[-1]["env_step"], "epoch": float(epochs), **final}
    (out / "final_eval.json").write_text(json.dumps(final, indent=1) + "\n")
    report(rows + [final], args.turns, out)
    print(f"metrics: {out / 'metrics.jsonl'} (the evaluation after the last update: {out / 'final_eval.json'})")


if __name__ == "__main__":
    main()
