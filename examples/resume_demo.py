"""Resume training, then learn: our user document's resume example, and the same example at a
learning rate that learns, both on a built-in tiny model, offline.

Part 1 is the document's "Resume training" example, as written: two agents train for two epochs
with a checkpoint after each, then the same run continues for two more epochs from the newest
checkpoint, in the same W&B run. The task asks the second agent to answer 2-3 times longer than the
first. At the document's learning rate (5e-6, CoMLRL's default) a randomly initialised tiny model
barely moves in four epochs: part 1 shows that a resumed run continues the same curve, not that the
agents learn.

Part 2 trains the same example at learning rate 1e-3 for 16 epochs, stopped and resumed twice
(after epochs 5 and 10) exactly as part 1 resumes: the mean reward rises from about 0.4 to about
1.0 across both resumes.

Changes to the document's code: ``model_name`` is a local tiny model directory (this machine has no
model hub; pass ``--model Qwen/Qwen2.5-0.5B``, or a local copy of it, to run the original), and
``build_trainer`` passes extra config settings through (part 2's learning rate).

    OMP_NUM_THREADS=1 python examples/resume_demo.py     # under a minute on 2 CPU cores

It ends with a table of both runs' reward per epoch and a plot, ``runs/resume-demo/reward_curve.png``.
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
from comlrl.utils import find_latest_checkpoint, read_checkpoint_metadata

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="model directory or hub name (default: built-in tiny Qwen2)")
parser.add_argument("--workdir", default="runs/resume-demo", help="where checkpoints, wandb/ and the plot go")
parser.add_argument("--keep", action="store_true", help="keep an existing workdir instead of starting anew")
parser.add_argument("--learning-rate", type=float, default=1e-3, help="part 2's learning rate (default 1e-3)")
parser.add_argument("--stops", default="5,10,16",
                    help="part 2: epochs at which each piece of the run stops; the last is the whole run")
cli = parser.parse_args()
stops = [int(x) for x in cli.stops.split(",")]
if not stops or stops != sorted(set(stops)) or stops[0] < 1:
    parser.error(f"--stops must be increasing epoch counts such as 5,10,16; got {cli.stops!r}")

workdir = Path(cli.workdir)
if workdir.exists() and not cli.keep:
    shutil.rmtree(workdir)
workdir.mkdir(parents=True, exist_ok=True)
os.chdir(workdir)  # the document's relative paths (./checkpoints, ./wandb) land in the workdir
os.environ.setdefault("WANDB_SILENT", "true")

# ==== Part 1: the document's example, as written ==================================================

# ---- Setup ----------------------------------------------------------------------------------------
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


# The same function builds the trainer for both parts of the run, so the two trainers match.
# (``**settings`` is our one addition: part 2 passes its learning rate through it.)
def build_trainer(num_train_epochs, wandb_config, **settings):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
        **settings,
    )
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer,
        reward_func=length_ratio_reward,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
    )


# ---- Training with checkpoints ------------------------------------------------------------------
# With checkpoint_dir, the trainer saves a checkpoint after every epoch.
wandb_config = {"project": "comlrl-examples", "name": "resume-demo"}
checkpoint_dir = "./checkpoints/resume-demo"

trainer = build_trainer(num_train_epochs=2, wandb_config=wandb_config)
trainer.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)

print("part 1, checkpoints after training:", sorted(p.name for p in Path(checkpoint_dir).glob("checkpoint-*")))

# ---- Continuing the run -------------------------------------------------------------------------
# The newest checkpoint holds the W&B run id; adding it to wandb_config sends the new rows to the
# same W&B run.
checkpoint = max(
    Path(checkpoint_dir).glob("checkpoint-*"),
    key=lambda path: int(path.name.rsplit("-", 1)[1]),
)
identity = read_checkpoint_metadata(checkpoint)["wandb"]
if identity:
    wandb_config = {**wandb_config, **identity, "resume": "allow"}

# num_train_epochs counts the whole run: 4 adds two epochs to the two already done.
trainer = build_trainer(num_train_epochs=4, wandb_config=wandb_config)
trainer.train(
    resume_from_checkpoint=str(checkpoint),
    checkpoint_dir=checkpoint_dir,
    checkpoint_interval=1,
)
document_run = {"dir": Path(checkpoint_dir), "resumed_after": [2], "wandb": identity}
# The resumed rows continue the same curve: rows are logged at env_step, and the checkpoint holds
# env_step and every random state. A run stopped mid-epoch resumes the same way, redoing the work
# since its last checkpoint (W&B ignores steps it already has). Only a few settings may differ on
# resume (num_train_epochs, devices, logging and checkpoint intervals); any other change is refused.

# ==== Part 2: the same example at a learning rate that learns =====================================
# A new run: the learning rate is part of what a checkpoint must match, so a resume that changes
# it is refused. The run is trained in pieces (5 epochs, then resumed to 10, then to 16 by default),
# each resume done as above: newest checkpoint, its W&B identity, the same build_trainer.
learning_dir = "./checkpoints/learning-demo"
learning_wandb = {"project": "comlrl-examples", "name": "learning-demo"}
resumed_after = []
for num_train_epochs in stops:
    checkpoint = find_latest_checkpoint(learning_dir)  # None before the first piece
    wandb_config = learning_wandb
    if checkpoint is not None:
        metadata = read_checkpoint_metadata(checkpoint)
        resumed_after.append(metadata["epoch"])
        if metadata["wandb"] and wandb_config is not None:
            wandb_config = {**wandb_config, **metadata["wandb"], "resume": "allow"}
    trainer = build_trainer(num_train_epochs=num_train_epochs, wandb_config=wandb_config,
                            agent_learning_rate=cli.learning_rate)
    trainer.train(
        resume_from_checkpoint=None if checkpoint is None else str(checkpoint),
        checkpoint_dir=learning_dir,
        checkpoint_interval=1,
    )
learning_run = {"dir": Path(learning_dir), "resumed_after": resumed_after,
                "wandb": read_checkpoint_metadata(find_latest_checkpoint(learning_dir))["wandb"]}

# ==== The curves ==================================================================================


def read_rows(run):
    return [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]


def per_epoch(rows):
    """One entry per epoch: (epoch, its last env_step, mean, min and max reward of its joint actions)."""
    epochs = {}
    for row in rows:
        epochs.setdefault(math.ceil(row["epoch"] - 1e-9), []).append(row)
    return [(epoch, group[-1]["env_step"], sum(r["train/reward_mean"] for r in group) / len(group),
             min(r["train/reward_min"] for r in group), max(r["train/reward_max"] for r in group))
            for epoch, group in sorted(epochs.items())]


def last_epochs_mean(table, n=4):
    last = table[-min(n, len(table)):]
    return sum(entry[2] for entry in last) / len(last), len(last)


def lr_text(value):
    return f"{value:g}".replace("e-0", "e-")  # 5e-6, 0.001


runs = {
    f"part 1: the document, lr {lr_text(MAGRPOConfig().agent_learning_rate)}": (document_run, read_rows(document_run)),
    f"part 2: lr {lr_text(cli.learning_rate)}": (learning_run, read_rows(learning_run)),
}
print(f"\n{'run':<31} {'epoch':>5} {'env_step':>8} {'reward':>7} {'min':>6} {'max':>6}")
for label, (run, rows) in runs.items():
    for i, (epoch, env_step, mean, low, high) in enumerate(per_epoch(rows)):
        note = f"  <- resumed from checkpoint-{epoch - 1}" if epoch - 1 in run["resumed_after"] else ""
        print(f"{label if i == 0 else '':<31} {epoch:>5} {env_step:>8} {mean:>7.3f} {low:>6.3f} {high:>6.3f}{note}")
print("(reward of a joint action: 1.0 when agent 2's answer is 2-3x as long as agent 1's, in characters)\n")
for label, (run, rows) in runs.items():
    table = per_epoch(rows)
    final, n = last_epochs_mean(table)
    print(f"{label}: mean reward {table[0][2]:.2f} in epoch 1, {final:.2f} over the last {n} epochs; "
          f"W&B run {run['wandb']}")

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("\n(install matplotlib for a plot of the curves: pip install matplotlib, or pip install -e '.[plot]' in the checkout)")
else:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (label, (run, rows)), color in zip(runs.items(), ("tab:grey", "tab:blue")):
        ax.plot([r["epoch"] for r in rows], [r["train/reward_mean"] for r in rows], color=color, alpha=0.3,
                linewidth=1)
        table = per_epoch(rows)
        ax.plot([entry[0] - 0.5 for entry in table], [entry[2] for entry in table], color=color, marker="o",
                markersize=3.5, label=f"{label}: per epoch (thin: per optimizer step)")
        for epoch in run["resumed_after"]:
            ax.axvline(epoch, color=color, linestyle="--", linewidth=1)
            ax.annotate(f"resumed from\ncheckpoint-{epoch}", (epoch, 0.03), xytext=(3, 0), textcoords="offset points",
                        fontsize=7, color=color)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(left=0)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean reward")
    ax.set_title("resume-demo: each run is one curve across its resumes (dashed lines)")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig("reward_curve.png", dpi=120)
    print(f"\nplot: {Path('reward_curve.png').resolve()}")
