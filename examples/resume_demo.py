"""The seed document "Reanudar Entrenamiento" (resume training), run as written.

Two agents are trained for two epochs with a checkpoint after each, then the same run continues
for two more epochs from the newest checkpoint, in the same W&B run. The task asks the second
agent to answer 2-3 times longer than the first.

The only change from the document: ``model_name`` is a local tiny model directory (this machine has
no model hub). Pass ``--model Qwen/Qwen2.5-0.5B`` (or a local copy of it) to run the original.

    python examples/resume_demo.py            # ~1 minute on a laptop CPU
"""

import argparse
import json
import math
import os
import shutil
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.testing import tiny_model_dir
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="model directory or hub name (default: built-in tiny Qwen2)")
parser.add_argument("--workdir", default="runs/resume-demo", help="where checkpoints, wandb/ and the plot go")
parser.add_argument("--keep", action="store_true", help="keep an existing workdir instead of starting anew")
cli = parser.parse_args()

workdir = Path(cli.workdir)
if workdir.exists() and not cli.keep:
    shutil.rmtree(workdir)
workdir.mkdir(parents=True, exist_ok=True)
os.chdir(workdir)  # the document's relative paths (./checkpoints, ./wandb) land in the workdir
os.environ.setdefault("WANDB_SILENT", "true")

# ---- Configuración (as in the document) --------------------------------------------------------
model_name = cli.model or str(tiny_model_dir())
tokenizer = AutoTokenizer.from_pretrained(model_name)
train_dataset = Dataset.from_dict({
    "prompt": [
        "Describe a city in the clouds:",
        "Invent a new holiday and explain it:",
        "Write a bedtime story for a dragon:",
        "Design a playground on Mars:",
    ]
})


def length_ratio_reward(completions1, completions2):
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards


def build_trainer(num_train_epochs, wandb_config):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
    )
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer,
        reward_func=length_ratio_reward,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
    )


# ---- Entrenamiento con Puntos de Control -------------------------------------------------------
wandb_config = {"project": "comlrl-examples", "name": "resume-demo"}
checkpoint_dir = "./checkpoints/resume-demo"

trainer = build_trainer(num_train_epochs=2, wandb_config=wandb_config)
trainer.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)

print("checkpoints:", sorted(p.name for p in Path(checkpoint_dir).glob("checkpoint-*")))

# ---- Continuar la Ejecución --------------------------------------------------------------------
checkpoint = max(
    Path(checkpoint_dir).glob("checkpoint-*"),
    key=lambda path: int(path.name.rsplit("-", 1)[1]),
)
identity = read_checkpoint_metadata(checkpoint)["wandb"]
if identity:
    wandb_config = {**wandb_config, **identity, "resume": "allow"}

trainer = build_trainer(num_train_epochs=4, wandb_config=wandb_config)
trainer.train(
    resume_from_checkpoint=str(checkpoint),
    checkpoint_dir=checkpoint_dir,
    checkpoint_interval=1,
)

# ---- The curve -----------------------------------------------------------------------------------
rows = [json.loads(line) for line in Path(checkpoint_dir, "metrics.jsonl").read_text().splitlines()]
print(f"\ncheckpoints: {sorted(p.name for p in Path(checkpoint_dir).glob('checkpoint-*'))}")
print("(the document's default learning rate, 5e-6, barely moves a random tiny model in 4 epochs; at 1e-3 "
      "it learns the task, mean reward 0.37 -> 0.99 in 40 epochs: see tests/test_learning.py)")
print(f"W&B run: {identity}")
print(f"\n{'env_step':>8} {'epoch':>6} {'reward':>8} {'len agent0':>10} {'len agent1':>10}")
for r in rows:
    print(f"{r['env_step']:>8} {r['epoch']:>6.2f} {r['train/reward_mean']:>8.3f} "
          f"{r['train/agent_0/completion_length']:>10.1f} {r['train/agent_1/completion_length']:>10.1f}")
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["env_step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["train/reward_mean"] for r in rows], marker="o")
    last_first_part = max(r["env_step"] for r in rows if r["epoch"] <= 2)
    ax.axvline(last_first_part, color="grey", linestyle="--", label="resumed here")
    ax.set_xlabel("env_step")
    ax.set_ylabel("mean reward")
    ax.set_title("resume-demo: one curve across train + resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig("reward_curve.png", dpi=120)
    print(f"\nplot: {Path('reward_curve.png').resolve()}")
except ImportError:
    print("\n(install matplotlib for a plot of the curve)")
