"""Subprocess for test_checkpoint_safety.py: train the seed task into a checkpoint directory.

``--slow S`` sleeps S seconds per optimizer step (a long run, for lock tests); ``--hold FILE`` makes
every optimizer step after the first wait until FILE exists (a run that is certainly still going
while a test does something else, however slow the machine); ``--fail-after N``
limits the size of any file this process writes right after checkpoint N is committed (as a full
disk would), so the next checkpoint write fails with EFBIG.
"""

import argparse
import os
import resource
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import comlrl.checkpoint.files as files  # noqa: E402
import comlrl.engine.trainer as magrpo  # noqa: E402  (the optimizer step of every family)
from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("run_dir", type=Path)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--hold", type=Path, default=None)
parser.add_argument("--fail-after", type=int, default=None)
opts = parser.parse_args()

if opts.slow or opts.hold:
    apply = magrpo.apply_gradients
    steps = []

    def slow_apply(*args, **kwargs):
        time.sleep(opts.slow)
        if opts.hold is not None and steps:
            deadline = time.time() + 600
            while not opts.hold.exists() and time.time() < deadline:
                time.sleep(0.05)
        steps.append(1)
        return apply(*args, **kwargs)

    magrpo.apply_gradients = slow_apply
if opts.fail_after is not None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond the limit fails with EFBIG, not a signal
    write = files.write_checkpoint

    def write_then_fill_the_disk(directory, snap, name=None):
        path = write(directory, snap, name)
        if snap.number == opts.fail_after:
            resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
        return path

    files.write_checkpoint = write_then_fill_the_disk

path = tiny_model_dir()
trainer = MAGRPOTrainer(
    agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
    tokenizer=AutoTokenizer.from_pretrained(path),
    reward_func=length_ratio_reward,
    train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
    args=MAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": opts.epochs, "max_new_tokens": 12,
                         "agent_learning_rate": 1e-3, "output_dir": str(opts.run_dir / "out")}),
)
trainer.train(checkpoint_dir=opts.run_dir)
