"""Plain helpers shared by the tests (importable: the tests folder is on sys.path)."""

from comlrl.testing import SEED_PROMPTS, length_ratio_reward

__all__ = ["SEED_PROMPTS", "length_ratio_reward"]
