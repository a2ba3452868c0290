"""Cooperative code generation: agent 1 writes a helper ``aux``, agent 2 the entry-point function
that may call it, judged by the task's unit tests in :mod:`comlrl.sandbox` (docs/code.md).

    from comlrl.tasks.code import (load_humaneval, train_eval_split, helper_formatter, main_formatter,
                                   code_collab_reward, test_feedback_transition)

    train, evals = train_eval_split(load_humaneval(), eval_size=32)   # or generated_split(): no package needed
    trainer = MAGRPOTrainer(agents=[...], formatters=[helper_formatter, main_formatter],
                            reward_func=code_collab_reward(), train_dataset=train, ...)
"""

from .data import COLUMNS, humaneval_split, load_humaneval, repeat_rows, tests_for, train_eval_split
from .evaluation import CodeEvalLogger, code_eval_logger, pass_at_k, pass_at_k_aggregator
from .generated import GENERATED_COLUMNS, generated_rows, generated_split
from .feedback import TestFeedback, test_feedback_transition
from .program import Structure, extract_function, joint_program, structure
from .prompts import HELPER_NAME, helper_formatter, main_formatter, single_formatter
from .rewards import (CodeCollabReward, CollabLevels, PassRateReward, code_collab_reward, pass_rate_reward,
                      score_collab)

__all__ = [
    "load_humaneval", "train_eval_split", "humaneval_split", "repeat_rows", "tests_for", "COLUMNS",
    "generated_split", "generated_rows", "GENERATED_COLUMNS",
    "helper_formatter", "main_formatter", "single_formatter", "HELPER_NAME",
    "code_collab_reward", "pass_rate_reward", "CodeCollabReward", "PassRateReward", "CollabLevels", "score_collab",
    "test_feedback_transition", "TestFeedback",
    "pass_at_k", "code_eval_logger", "pass_at_k_aggregator", "CodeEvalLogger",
    "extract_function", "joint_program", "structure", "Structure",
]
