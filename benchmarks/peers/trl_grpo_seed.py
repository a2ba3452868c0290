"""The seed workload, per agent, on TRL's ``GRPOTrainer`` (``trl==1.16.0``; a peer of benchmarks/throughput.py).

    /tmp/venv-trl/bin/python benchmarks/peers/trl_grpo_seed.py --model-dir DIR [--epochs 3] ...

Runs in its own virtual environment (see benchmarks/README.md). GRPO trains ONE policy, so this is
the work of one MAGRPO agent: each prompt's K completions in one batch (per_device_train_batch_size
= num_generations = K, one optimizer step per prompt), TRL's default batched transformers
``generate`` (no vLLM), on ``--device`` (default the CPU: ``use_cpu=True``). Settings that would
change the amount of work are set to match comlrl: the models' ``--dtype`` (float32 by default, with
``bf16=False``; TRL defaults to bf16, which ``--dtype bfloat16`` turns on), no gradient checkpointing
(TRL defaults to it), beta 0 (no reference model, TRL's default), num_iterations 1, constant
learning rate, one checkpoint per epoch. The reward is the seed's length ratio of the completion against
the prompt (the partner agent's text does not exist here). Prints one JSON line.
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, length_ratio, model_dtype, parser, peak_gpu_mb, peak_rss_mb, setup  # noqa: E402

GENERATED_TOKENS = [0]


def reward(prompts, completions, completion_ids=None, **kwargs):
    if completion_ids is not None:
        GENERATED_TOKENS[0] += sum(len(ids) for ids in completion_ids)
    return [length_ratio(p, c) for p, c in zip(prompts, completions)]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    prompts = setup(args)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", fp16=False,
            gradient_checkpointing=False,
            num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
            per_device_train_batch_size=args.num_generations, gradient_accumulation_steps=1,
            num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            beta=0.0, num_iterations=1, loss_type="grpo", scale_rewards="none",
            logging_steps=1, report_to="none", disable_tqdm=True,
            save_strategy="epoch" if args.checkpoint else "no", save_only_model=False,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=model_dtype(args)),
            reward_funcs=reward, args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(args.model_dir),
        )
        assert all(p.device.type == args.device.split(":")[0] for p in trainer.model.parameters())
        assert not getattr(trainer.model, "is_activation_checkpointing", getattr(trainer.model, "is_gradient_checkpointing", False))
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        saved = sorted(p.name for p in Path(tmp).glob("checkpoint-*"))
    env_steps = trainer.state.global_step * args.num_generations  # completions scored
    emit({
        "framework": f"trl {trl.__version__} GRPOTrainer (1 policy)",
        "epochs": args.epochs, "elapsed_s": elapsed,
        "seconds_per_epoch": elapsed / args.epochs,
        "env_steps": env_steps, "env_steps_per_s": env_steps / elapsed,
        "generated_tokens_per_s": GENERATED_TOKENS[0] / elapsed,
        "optimizer_steps": trainer.state.global_step,
        "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb(), "checkpoint_dir_entries": saved,
        "device": args.device, "dtype": args.dtype,
    })


if __name__ == "__main__":
    main()
