"""Writing a new trainer: the public surface of comlrl's engine (docs/extending.md).

A trainer family subclasses :class:`Trainer` (or a family's trainer, such as
:class:`MAGRPOTrainer`) and implements the phases of one rollout buffer::

    collect(mine, epoch, timer) -> PlayedBuffer      rollout (play_episodes), score, advantage
    optimizer_step(buffer, groups) -> metrics         update: backward, then step_modules(...)
    update_passes() -> int                            passes of optimizer steps over a buffer (PPO)
    trained_slots() -> Slots                          extra trained modules and their checkpoint slots
    algorithm_state() / load_algorithm_state(...)     JSON state of the algorithm, checkpointed
    fingerprint_extra() -> dict                       what a resumed run must share beyond the config

The run loop calls a trainer only through :class:`LoopTrainer` (``run_schedule``, ``train_buffer``,
``eval_due``, ...; :class:`Trainer` implements all of it) and offers it only :class:`TrainingLoop`
(``run_epoch``, ``checkpoint``, ``log``): a family with phases of its own (MADPO's pair sets,
MARLHF's reward model) overrides ``run_schedule`` and calls those three; a phase that trains on
other buffers passes its own :class:`EpochSchedule` to ``run_epoch``.

Choices are registered by name, one function each: ``register_advantage(name)`` (an estimator
``advantage_mode`` can select) and ``register_policy_loss(name)`` (a loss a
:class:`PolicyLossSpec` names; ``MAGRPOTrainer.policy_loss_spec`` picks the run's).

The engine does the rest: the epoch loop and data order, evaluation cadence, logging at
``env_step`` to every tracker, checkpoints (atomic, hashed, locked, loadable folders) and exact
resume, data parallelism under torchrun, LoRA agents, the CLI (``comlrl train`` finds every
``<Name>Trainer`` with a config class).

Everything exported here is covered by tests (tests/test_extending.py) and kept stable; names
with a leading underscore elsewhere in comlrl are internals and may change.
"""

from ._imports import require_torch

require_torch("comlrl.extend")  # before the first torch import: say how to install it

from .checkpoint.manager import Slots
from .engine.config import check_bool, check_choice, check_float, check_int, check_str, config_class, optional, setting
from .engine.distributed import all_reduce_sum
from .engine.episode import Node, Turn
from .engine.metrics import record_turns
from .engine.schedule import EpochSchedule, LoopTrainer, TrainingLoop
from .engine.settings import TrainerConfig
from .engine.state import PlayedBuffer, TrainState
from .engine.step import (ADVANTAGE_WEIGHTS, OLD_LOG_PROBS, AgentRows, StepLoss, concat_rollouts, policy_backward,
                          rows_log_probs, select_rows, step_denominator)
from .engine.timing import PhaseTimer
from .engine.trainer import Trainer
from .functional import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PolicyLossSpec, Registry, clipped_policy_loss,
                         discounted_returns, group_advantages, policy_gradient_loss, register_advantage,
                         register_policy_loss, sequence_kl, sequence_log_probs, sequence_ratio)
from .rollout import Rollout
from .trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

__all__ = [
    # the base classes and their configs
    "Trainer", "TrainerConfig", "MAGRPOTrainer", "MAGRPOConfig",
    # the contract of the run loop and a trainer (engine/schedule.py): what each calls of the other
    "LoopTrainer", "TrainingLoop", "EpochSchedule",
    # declaring config fields (checked when the config is built)
    "config_class", "setting", "check_int", "check_float", "check_choice", "check_bool", "check_str", "optional",
    # the records the phases hand each other
    "Rollout", "Node", "Turn", "PlayedBuffer", "AgentRows", "StepLoss", "Slots", "TrainState", "PhaseTimer",
    # the update phase
    "policy_backward", "rows_log_probs", "step_denominator", "concat_rollouts", "select_rows", "OLD_LOG_PROBS",
    "ADVANTAGE_WEIGHTS", "record_turns",
    # every process together (under torchrun): sums of what a trainer logs, through self.dist
    "all_reduce_sum",
    # choices by name: advantage estimators (advantage_mode) and policy losses (PolicyLossSpec.name)
    "register_advantage", "ADVANTAGE_ESTIMATORS", "register_policy_loss", "POLICY_LOSSES", "PolicyLossSpec",
    "Registry",
    # pure tensor functions
    "group_advantages", "discounted_returns", "policy_gradient_loss", "clipped_policy_loss", "sequence_ratio",
    "sequence_kl", "sequence_log_probs",
]
