"""Configs of the actor-critic family: IAC and MAAC (CoMLRL 1.4.3's fields and defaults, plus the
settings every comlrl trainer shares)."""

from __future__ import annotations

from typing import Optional

from ...engine.config import check_bool, check_choice, check_float, check_int, config_class, optional, setting
from ...engine.settings import Devices, TrainerConfig, check_devices
from ...exceptions import ConfigError

__all__ = ["ActorCriticConfig", "IACConfig", "MAACConfig", "CRITIC_TYPES"]

CRITIC_TYPES = ("v", "q")
_lr = check_float(lambda v: v > 0, "> 0")
_head_dim = optional(check_int(0))


@config_class
class ActorCriticConfig(TrainerConfig):
    """Settings shared by IAC and MAAC. Buffers and batches count samples per agent, as in CoMLRL:
    with ``num_generations`` K, a buffer holds ``ceil(rollout_buffer_size / K)`` prompts' episodes
    (every turn of them) and an optimizer step ``ceil(train_batch_size / K)`` prompts'."""

    DERIVED_DEFAULTS = {"critic_learning_rate": "agent_learning_rate"}  # CoMLRL: None = the agents' rate

    num_train_epochs: int = setting(40, "Epochs in the WHOLE run; resuming with a larger value extends it.",
                                    check_int(1), may_change=True)
    logging_steps: int = setting(1, "Log a metrics row once env_step has advanced this many joint actions "
                                    "since the last row (1 = after every optimizer step).",
                                 check_int(1), may_change=True)
    num_generations: int = setting(1, "Completions each agent samples per prompt (1 for multi-turn).",
                                   check_int(1))
    top_k: Optional[int] = setting(None, "Keep only the k most likely tokens; None or 0 = no limit.",
                                   optional(check_int(0)))
    rollout_buffer_size: int = setting(8, "Samples per agent collected before the agents are updated on them "
                                          "(ceil(rollout_buffer_size / num_generations) prompts).", check_int(1))
    train_batch_size: Optional[int] = setting(None, "Samples per agent per optimizer step; None = "
                                                    "rollout_buffer_size (one step per buffer).",
                                              optional(check_int(1)))
    advantage_normalization: bool = setting(True, "Standardise the TD advantages of each turn within a buffer "
                                                  "(mean 0, population std 1).", check_bool)
    critic_learning_rate: Optional[float] = setting(5.0e-6, "AdamW learning rate of the critics; None = "
                                                            "agent_learning_rate.", optional(_lr))
    value_loss_coef: float = setting(0.6, "Weight of the critic's squared-error loss.",
                                     check_float(lambda v: v >= 0, ">= 0"))
    critic_type: str = setting("v", "'v': the critic values the prompt (state value); 'q': the prompt and the "
                                    "completion (action value).", check_choice(*CRITIC_TYPES))
    critic_devices: Devices = setting(None, "Devices of the critics; None = the agents' devices.", check_devices,
                                      may_change=True)

    def _check_generations(self) -> None:
        """A critic is the baseline, so K = 1 is allowed; several turns need K = 1 (the next
        state of a turn is one joint answer's)."""
        if self.num_turns > 1 and self.num_generations != 1:
            raise ConfigError(f"num_turns={self.num_turns} needs num_generations=1 for actor-critic training (each "
                              f"turn continues from the one joint answer it sampled), got num_generations="
                              f"{self.num_generations}. Set num_generations=1 or num_turns=1.")

    def validate(self) -> None:
        super().validate()
        if self.parallel_training == "mp" and self._needs_critic_devices() and self.critic_devices is None:
            raise ConfigError("parallel_training='mp' needs explicit critic_devices (the critics' devices, e.g. "
                              "['cuda:2', 'cuda:3']); set critic_devices or use parallel_training='none'.")

    def _needs_critic_devices(self) -> bool:
        return True


@config_class
class IACConfig(ActorCriticConfig):
    """Independent actor-critic: each agent learns from its own critic, a separate model
    (``use_separate_critic=True``) or a value head on the agent itself."""

    value_clip_range: Optional[float] = setting(0.2, "Clip each value's change against its rollout-time value in the "
                                                     "value loss (PPO); None = no clipping.",
                                                optional(check_float(lambda v: v >= 0, ">= 0")))
    use_separate_critic: bool = setting(True, "True: one critic model per agent (critics=... or critic_model=...); "
                                              "False: a value head on each agent, trained with it.", check_bool)
    critic_value_head_hidden_dim: Optional[int] = setting(None, "Hidden width of the separate critics' value heads "
                                                                "(None or 0: one linear layer).", _head_dim)
    value_head_hidden_dim: Optional[int] = setting(None, "Hidden width of the agents' own value heads "
                                                         "(use_separate_critic=False).", _head_dim)

    def _needs_critic_devices(self) -> bool:
        return self.use_separate_critic


@config_class
class MAACConfig(ActorCriticConfig):
    """Multi-agent actor-critic: one centralised critic sees every agent's prompt (``critic_type='v'``)
    or every prompt and the joint answer (``'q'``), and is the baseline of every agent."""

    critic_value_head_hidden_dim: Optional[int] = setting(None, "Hidden width of the critic's value head (None: "
                                                                "model_config['critic_value_head_hidden_dim'], else "
                                                                "one linear layer).", _head_dim)
