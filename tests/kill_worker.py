"""The process test_kill.py kills: train (resuming from the newest checkpoint if any), then write
the final weights. Killed with SIGKILL at random moments by the test.

test_kill.py forks :func:`main` from a server that imported torch, transformers and comlrl once
(``helpers.forked``)."""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from comlrl.utils import find_latest_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward  # noqa: E402


def main(run_dir: Path, slow: float = 0.0, family: str = "magrpo") -> None:
    if slow:
        # Stretch every file write of a checkpoint save so that random kills often land inside one.
        import comlrl.checkpoint.files as ckpt

        def stretched(write):
            def wrapper(*args, **kwargs):
                time.sleep(slow)
                result = write(*args, **kwargs)
                time.sleep(slow)
                return result
            return wrapper

        ckpt._write_tensors = stretched(ckpt._write_tensors)
    path = tiny_model_dir()
    settings = {**TEST_SETTINGS, "num_train_epochs": 3, "max_new_tokens": 10, "agent_learning_rate": 1e-3,
                "output_dir": str(run_dir / "out")}
    inputs = dict(agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
                  tokenizer=AutoTokenizer.from_pretrained(path), reward_func=length_ratio_reward,
                  train_dataset=[{"prompt": p} for p in SEED_PROMPTS])
    if family == "maac":  # a critic, its optimizer and a reference KL too
        from comlrl.trainers.actor_critic import MAACConfig, MAACTrainer

        settings.pop("loss_type")
        trainer = MAACTrainer(critic_model=path, **inputs, args=MAACConfig(
            **settings, critic_learning_rate=1e-3, reference_kl_enabled=True, reference_kl_coef=0.05))
    elif family == "madpo_iter":  # pairs, replay, iterations
        from comlrl.trainers.preference import MADPOIterConfig, MADPOIterTrainer

        keep = {"max_new_tokens", "agent_learning_rate", "output_dir", "temperature", "top_p", "weight_decay",
                "max_grad_norm", "logging_steps"}
        trainer = MADPOIterTrainer(**inputs, args=MADPOIterConfig(
            **{k: v for k, v in settings.items() if k in keep}, num_iterations=3, num_train_epochs=2,
            preference_num_candidates=4, preference_pairs_per_sample=2, train_batch_size=2, eval_interval=0,
            preference_replay_mode="nearest_k", preference_replay_k=2))
    else:
        trainer = MAGRPOTrainer(**inputs, args=MAGRPOConfig(**settings))
    latest = find_latest_checkpoint(run_dir / "ckpt")
    trainer.train(resume_from_checkpoint=latest, checkpoint_dir=run_dir / "ckpt", save_steps=1,
                  checkpoint_total_limit=3)
    slots = trainer.trained_slots()
    tensors = {f"{s}.{n}": p.detach().contiguous() for s, m in slots.modules.items() for n, p in m.named_parameters()}
    for s, opt in slots.optimizers.items():
        for idx, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                tensors[f"{s}.opt.{idx}.{k}"] = v.detach().reshape(-1).contiguous()
    save_file(tensors, str(run_dir / "final.safetensors"))
