"""Build (or find in the cache) the small code model of comlrl.testing.code_model_dir() and measure
it: build time (wall and CPU seconds: CPU is what a loaded machine cannot inflate), parameters, and
the warm model's pass@1 on the generated task's held-out problems, measured as
examples/code_collab.py measures it (MAGRPOTrainer.evaluate with the code task's eval hooks).

    python scripts/build_code_model.py [--steps N] [--seed 0] [--cache-dir DIR] [--no-eval] [--write-asset]

The package ships the default model (comlrl/assets/code-model, with the recipe it was built from),
so a fresh machine copies it rather than spending minutes building it; the copy is used only while
its recipe equals the script's (tests/test_code_model.py checks that). After changing the corpus,
the shape or the training, run with --write-asset: it builds here (never from the shipped copy) and
replaces the package's copy.
"""

import argparse
import os
import resource
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: comlrl.testing.CODE_MODEL_STEPS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--no-eval", action="store_true")
    parser.add_argument("--write-asset", action="store_true",
                        help="build here and replace the package's copy (comlrl/assets/code-model)")
    args = parser.parse_args()
    os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
    from comlrl.testing import CODE_MODEL_STEPS, code_model_dir, write_code_model_asset

    args.steps = CODE_MODEL_STEPS if args.steps is None else args.steps

    wall, cpu = time.perf_counter(), time.process_time()
    # --write-asset builds afresh (a cached build may predate a change to the corpus or training).
    cache_dir = tempfile.mkdtemp(prefix="code-model-build-") if args.write_asset else args.cache_dir
    path = code_model_dir(steps=args.steps, seed=args.seed, cache_dir=cache_dir, log_every=25,
                          build=args.write_asset)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if args.write_asset:
        print(f"package copy: {write_code_model_asset(path, steps=args.steps, seed=args.seed)}")
    print(f"model: {path}\nbuild (or cache lookup): {wall:.1f} s wall, {cpu:.1f} s CPU "
          f"(max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    if args.no_eval:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.sandbox import Sandbox
    from comlrl.tasks.code import (code_collab_reward, code_eval_logger, generated_split, helper_formatter,
                                   main_formatter, pass_at_k_aggregator, repeat_rows)
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    agents = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
    print(f"parameters: {sum(p.numel() for p in agents[0].parameters()):,} per agent")
    train, evals = generated_split()
    with Sandbox(timeout_s=5) as sandbox:
        trainer = MAGRPOTrainer(agents=agents, tokenizer=AutoTokenizer.from_pretrained(path),
                                formatters=[helper_formatter, main_formatter], reward_func=code_collab_reward(sandbox),
                                train_dataset=train, eval_dataset=repeat_rows(evals, 4),
                                eval_logger=code_eval_logger(sandbox),
                                eval_aggregator=pass_at_k_aggregator(), args=MAGRPOConfig(
                                    num_turns=1, num_generations=4, max_new_tokens=48, eval_num_samples=0,
                                    eval_batch_size=16,
                                    seed=args.seed, output_dir=tempfile.mkdtemp(prefix="code-model-eval-")))
        start = time.perf_counter()
        metrics = trainer.evaluate()
        trainer.close()
    print(f"warm pass@1 on {len(evals)} held-out problems, 4 answers each: {metrics['eval/pass@1']:.3f} "
          f"(reward {metrics['eval/reward_mean']:.3f}; {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
