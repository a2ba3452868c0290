"""Checkpoint save/load time and size against the raw bytes of the tensors saved.

    python benchmarks/checkpoint_bench.py [--hidden 64 --layers 2] [--repeats 5]

Builds the seed workload (2 agents), takes one optimizer step so AdamW has state, then saves and
loads checkpoints repeatedly and prints the median times and the sizes.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.checkpoint import files as ckpt  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402
from peers.common import PROMPTS, reward  # noqa: E402  (benchmarks/ is on sys.path: scripts run from here)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = tiny_model_dir(hidden_size=args.hidden, num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = MAGRPOTrainer(
            agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
            tokenizer=AutoTokenizer.from_pretrained(path),
            reward_func=reward,
            train_dataset=[{"prompt": p} for p in PROMPTS],
            args=MAGRPOConfig(num_turns=1, num_train_epochs=1, max_new_tokens=8, agent_learning_rate=1e-3,
                              output_dir=tmp),
        )
        trainer.train()
        trainer.checkpoints.open(Path(tmp) / "ckpts", trainer.run_id, resumed_number=None)
        raw = sum(t.numel() * t.element_size() for m in trainer.agents for t in {p.data_ptr(): p for p in m.parameters()}.values())
        raw_opt = sum(v.numel() * v.element_size() for o in trainer.optimizers for s in o.state.values()
                      for v in s.values() if hasattr(v, "numel"))
        saves, loads = [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            saved = trainer.save_run_checkpoint(trainer.state.checkpoint + 1, limit=1)
            trainer.checkpoints.wait()  # the background write, committed
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.checkpoints.load(saved, trainer._saved_slots(), trainer._fingerprints())
            loads.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
        state_json = (saved / ckpt.STATE_FILE).stat().st_size
    print(f"model: 2 x Qwen2 hidden {args.hidden}, {args.layers} layers, vocab 512 (fp32)")
    print(f"raw tensor bytes: weights {raw / 1e6:.3f} MB + AdamW moments {raw_opt / 1e6:.3f} MB "
          f"= {(raw + raw_opt) / 1e6:.3f} MB")
    print(f"checkpoint on disk: {size / 1e6:.3f} MB ({size / (raw + raw_opt):.3f}x raw; "
          f"trainer_state.json {state_json / 1e3:.1f} kB)")
    print(f"save (copy, write + fsync + sha256 + rename): median {statistics.median(saves) * 1e3:.1f} ms "
          f"over {args.repeats}")
    print(f"load (verify sha256 + fields + weights + optimizer + RNG): median {statistics.median(loads) * 1e3:.1f} ms")
    trainer.close()


if __name__ == "__main__":
    main()
