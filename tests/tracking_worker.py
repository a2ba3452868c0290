"""The process test_tracking.py runs and kills: train two agents with evaluation, logging to
metrics.jsonl, TensorBoard and MLflow (the server at ``uri``), resuming from the newest checkpoint
if there is one. With ``stall_after=N`` it stops after logging its N-th row and waits there to be
killed (kill -9 by the test, at a known point past a checkpoint).

test_tracking.py forks :func:`main` from a server that imported torch, transformers, comlrl and
mlflow once (``helpers.forked``).
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

import mlflow  # noqa: E402,F401  (imported once here, not per forked run)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from comlrl.utils import find_latest_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward  # noqa: E402

EVAL = [{"prompt": p} for p in ("Tell a joke about rain:", "Name three colours:")]


def main(run_dir: Path, experiment: str, uri: str, stall_after: int = 0) -> None:
    os.environ["MLFLOW_TRACKING_URI"] = uri
    if stall_after:
        from comlrl.engine.loop import RunLoop

        original, written = RunLoop._write_row, []

        def write_then_stall(self, row):
            out = original(self, row)
            written.append(out["env_step"])
            if len(written) == stall_after:
                (run_dir / "stalled").write_text(str(out["env_step"]))
                time.sleep(600)
            return out

        RunLoop._write_row = write_then_stall

    path = tiny_model_dir()
    settings = {**TEST_SETTINGS, "num_train_epochs": 3, "max_new_tokens": 10, "agent_learning_rate": 1e-3,
                "eval_interval": len(SEED_PROMPTS), "eval_num_samples": 2, "output_dir": str(run_dir / "out"),
                "report_to": ["jsonl", "tensorboard", "mlflow"], "mlflow_experiment_name": experiment}
    trainer = MAGRPOTrainer(agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
                            tokenizer=AutoTokenizer.from_pretrained(path), reward_func=length_ratio_reward,
                            train_dataset=[{"prompt": p} for p in SEED_PROMPTS], eval_dataset=EVAL,
                            args=MAGRPOConfig(**settings))
    latest = find_latest_checkpoint(run_dir / "ckpt")
    trainer.train(resume_from_checkpoint=latest, checkpoint_dir=run_dir / "ckpt")
