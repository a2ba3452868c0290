"""Train the seed task data-parallel: the same script runs alone or under torchrun.

    python examples/data_parallel.py                                  # one process
    torchrun --nproc_per_node 2 examples/data_parallel.py             # 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc_per_node 2 examples/data_parallel.py --lora --kl 0.05   # LoRA agents on one base + KL
    torchrun --nproc_per_node 2 examples/data_parallel.py --resume    # continue from the newest checkpoint

Each optimizer step's ``--train-batch-size`` prompts are split across the processes; rank 0 writes
the metrics, the checkpoints and the final models. See docs/scaling.md.
"""

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from comlrl import MAGRPOConfig, MAGRPOTrainer
from comlrl.testing import SEED_PROMPTS, length_ratio_reward, tiny_model_dir
from comlrl.utils import find_latest_checkpoint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="model directory or hub name (default: built-in tiny Qwen2)")
parser.add_argument("--workdir", default="runs/data-parallel")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--train-batch-size", type=int, default=4, help="prompts per optimizer step, all processes "
                                                                  "together")
parser.add_argument("--lora", action="store_true", help="agents = LoRA adapters on one shared base model")
parser.add_argument("--kl", type=float, default=0.0, help="reference_kl_coef (KL to each agent's initial policy); "
                                                           "0 = off")
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
cli = parser.parse_args()

model_name = cli.model or str(tiny_model_dir())
peft_config = None
if cli.lora:
    from peft import LoraConfig

    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
workdir = Path(cli.workdir)
trainer = MAGRPOTrainer(
    agent_model=model_name,
    num_agents=2,
    tokenizer=AutoTokenizer.from_pretrained(model_name),
    peft_config=peft_config,
    reward_func=length_ratio_reward,
    train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
    args=MAGRPOConfig(num_turns=1, num_train_epochs=cli.epochs, num_generations=4, max_new_tokens=32,
                      logging_steps=1, temperature=1.0, top_p=1.0, rollout_buffer_size=cli.train_batch_size,
                      reference_kl_enabled=cli.kl > 0, reference_kl_coef=cli.kl or 0.1, max_grad_norm=1.0,
                      agent_learning_rate=1e-3 if model_name != cli.model else 5e-6,
                      output_dir=str(workdir / "out")),
)
resume = find_latest_checkpoint(workdir / "checkpoints") if cli.resume else None
metrics = trainer.train(resume_from_checkpoint=resume, checkpoint_dir=workdir / "checkpoints")
trainer.save_model(workdir / "final")
if trainer.dist.is_main:
    print(f"{trainer.dist.world_size} process(es): reward {metrics.get('train/reward_mean', float('nan')):.3f} "
          f"after {trainer.state.global_step} steps; models in {workdir / 'final'}")
