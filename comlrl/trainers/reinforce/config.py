"""Configs of the REINFORCE family: MAGRPO and its named-baseline variants, and centralised MAGRPO."""

from __future__ import annotations

from typing import Optional

from ...engine.config import (check_choice, check_float, check_int, check_registered, config_class, optional,
                              resumable_fields, setting)
from ...engine.settings import TrainerConfig
from ...exceptions import ConfigError
from ...functional.advantages import ADVANTAGE_ESTIMATORS

__all__ = ["MAGRPOConfig", "MAREINFORCEConfig", "MARLOOConfig", "MAReMaxConfig", "CentralizedMAGRPOConfig",
           "ADVANTAGE_MODES", "JOINT_MODES", "LOSS_TYPES", "RESUMABLE_FIELDS"]

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")  # comlrl's own; advantage_mode takes any registered estimator
JOINT_MODES = ("aligned", "cross")
LOSS_TYPES = ("sequence", "grpo", "token_mean", "dr_grpo")


@config_class
class MAGRPOConfig(TrainerConfig):
    """Settings of a MAGRPO run (CoMLRL 1.4.3's fields and defaults, plus comlrl's own).

    Every invariant is checked when the config is built, and a field's own check again when it
    is assigned; a bad value raises :class:`comlrl.exceptions.ConfigError` (a ``ValueError``)
    naming the field and what to change.
    """

    joint_mode: str = setting("aligned", "'aligned': completion k of every agent forms joint action k (K per node); "
                                         "'cross': every combination (K**num_agents per node).",
                              check_choice(*JOINT_MODES, aliases={"align": "aligned", "crossed": "cross"}))
    advantage_mode: str = setting("mean", "Baseline: 'mean' (group mean), 'raw' (none), 'max' (group max), "
                                          "'rloo' (mean of the other samples).", check_registered(ADVANTAGE_ESTIMATORS))
    loss_type: str = setting("sequence", "'sequence': -A * sum of the completion's token log-probs, mean over "
                                         "completions (CoMLRL's REINFORCE objective); 'grpo': token mean per "
                                         "completion; 'token_mean': mean over all tokens; 'dr_grpo': sum / "
                                         "max_new_tokens.", check_choice(*LOSS_TYPES))
    max_joint_actions: int = setting(4096, "Refuse settings scoring more joint actions per prompt, all turns "
                                           "together (K**N per node in cross mode).", check_int(1))
    # comlrl's own: the clipped-ratio update (PPO / GRPO as TRL and verl run it)
    ppo_clip_eps: Optional[float] = setting(None, "Clip range eps of the clipped-ratio (PPO) loss, e.g. 0.2: each "
                                                  "token's ratio to the sampling policy is clipped to [1-eps, 1+eps]. "
                                                  "None: no clipping (the REINFORCE loss when num_update_epochs is 1).",
                                            optional(check_float(lambda v: 0 < v < 1, "in (0, 1)")))
    num_update_epochs: int = setting(1, "Passes of optimizer steps over each rollout buffer (PPO's epochs): "
                                        "later passes reuse the samples, weighted by the ratio to the sampling "
                                        "policy (clipped with ppo_clip_eps).", check_int(1))

    @property
    def ratio_loss(self) -> bool:
        """Whether updates use the ratio to the sampling policy (clipped or several passes)."""
        return self.ppo_clip_eps is not None or self.num_update_epochs > 1

    def validate(self) -> None:
        super().validate()
        if self.joint_mode == "cross" and self.num_agents > 1:
            per_node = self.num_generations ** self.num_agents
            if per_node > self.max_joint_actions:
                raise ConfigError(f"joint_mode='cross' scores num_generations**num_agents = {per_node} joint actions "
                                  f"per node, above max_joint_actions={self.max_joint_actions}. Lower "
                                  "num_generations, use joint_mode='aligned', or raise max_joint_actions.")


@config_class
class MAREINFORCEConfig(MAGRPOConfig):
    """MAGRPO without a baseline: the advantage is the return (multi-agent REINFORCE)."""

    advantage_mode: str = setting("raw", "Baseline: 'raw' (none) for MAREINFORCE.",
                                  check_registered(ADVANTAGE_ESTIMATORS))


@config_class
class MARLOOConfig(MAGRPOConfig):
    """MAGRPO with the leave-one-out baseline: the mean return of the group's other samples."""

    advantage_mode: str = setting("rloo", "Baseline: 'rloo' (mean of the others) for MARLOO.",
                                  check_registered(ADVANTAGE_ESTIMATORS))


@config_class
class MAReMaxConfig(MAGRPOConfig):
    """MAGRPO with the group's best return as baseline (ReMax-style; advantages <= 0)."""

    advantage_mode: str = setting("max", "Baseline: 'max' (the group's best) for MAReMax.",
                                  check_registered(ADVANTAGE_ESTIMATORS))


@config_class
class CentralizedMAGRPOConfig(MAGRPOConfig):
    """MAGRPO for ONE joint policy that writes every role's part in one completion.

    ``num_agents`` counts the roles; the trainer trains one model. Single-turn only.
    """

    num_turns: int = setting(1, "Turns per episode; centralised MAGRPO supports 1.", check_int(1))
    collaboration_mode: str = setting("centralized", "Must be 'centralized' for this config.",
                                      check_choice("centralized", "decentralized"))

    def validate(self) -> None:
        super().validate()
        if self.collaboration_mode != "centralized":
            raise ConfigError("CentralizedMAGRPOConfig requires centralized collaboration "
                              f"(collaboration_mode='centralized'), got {self.collaboration_mode!r}; use "
                              "MAGRPOConfig for one policy per agent.")
        if self.num_turns != 1:
            raise ConfigError(f"CentralizedMAGRPOConfig supports num_turns=1 only, got num_turns={self.num_turns}.")

    def _actor_count(self) -> int:
        return 1


RESUMABLE_FIELDS = resumable_fields(MAGRPOConfig)
