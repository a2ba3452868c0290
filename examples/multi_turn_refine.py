"""Two agents take turns refining a short text (multi-turn MAGRPO on a built-in tiny model).

Turn 1: the writer (agent 0) drafts, the editor (agent 1) answers with notes 2-3x as long.
Turn 2: the external transition shows both of them the draft; the writer now rewrites it 2-3x
longer than its own draft. A good episode needs both turns: the turn-2 reward depends on the
turn-1 draft, and the turn-1 return includes the discounted turn-2 reward.

    python examples/multi_turn_refine.py [--epochs 30] [--lr 1e-3]
"""

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.testing import tiny_model_dir
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

DRAFT = "\nDraft: "


def ratio_score(longer: str, shorter: str) -> float:
    """1.0 when ``longer`` is 2-3x as long as ``shorter``, decaying outside that band."""
    ratio = len(longer) / max(len(shorter), 1)
    return math.exp(-(0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))))


def refine_reward(completions1, completions2, prompts):
    """Turn 1 (plain prompt): editor 2-3x the writer. Turn 2 (prompt holds the draft): the
    writer's rewrite 2-3x its own draft. One call scores one task item's joint answers, so
    ``prompts`` holds that item's prompt (the writer's, this turn)."""
    prompt = prompts[0]
    rewards = []
    for writer, editor in zip(completions1, completions2):
        if DRAFT in prompt:
            rewards.append(ratio_score(writer, prompt.split(DRAFT, 1)[1]))
        else:
            rewards.append(ratio_score(editor, writer))
    return rewards


def transition(prompt, agent_completions):
    """The joint answer of turn 1 becomes both agents' next prompt."""
    draft, _notes = agent_completions
    return [f"Rewrite it longer.{DRAFT}{draft}", f"Review the rewrite.{DRAFT}{draft}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args()
    os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
    path = tiny_model_dir()
    out = Path(args.out or tempfile.mkdtemp(prefix="multi-turn-"))
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(path),
        reward_func=refine_reward,
        external_transition=transition,
        train_dataset=[{"prompt": p} for p in ("Describe a city in the clouds:", "Invent a new holiday:",
                                               "Write a bedtime story for a dragon:", "Design a playground on Mars:")],
        args=MAGRPOConfig(num_turns=2, discount=0.9, num_generations=4, max_new_tokens=32,
                          num_train_epochs=args.epochs, agent_learning_rate=args.lr, logging_steps=80,  # a row per epoch
                          temperature=1.0, top_p=1.0, early_termination_threshold=None, rollout_buffer_size=1,
                          loss_type="grpo", advantage_normalization=False, max_grad_norm=1.0,
                          external_prompt_passthrough=True, output_dir=str(out)),
    )
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"{'epoch':>5} {'turn 1':>7} {'turn 2':>7} {'return':>7}")
    for r in rows:
        print(f"{r['epoch']:>5.0f} {r['turn_1/reward_mean']:>7.3f} {r['turn_2/reward_mean']:>7.3f} "
              f"{r['train/return_mean']:>7.3f}")


if __name__ == "__main__":
    main()
