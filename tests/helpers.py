"""Plain helpers shared by the tests (importable: the tests folder is on sys.path)."""

import math

SEED_PROMPTS = [
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Design a playground on Mars:",
]


def length_ratio_reward(completions1, completions2):
    """The seed document's reward: agent 2 should answer 2-3x longer than agent 1."""
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards
