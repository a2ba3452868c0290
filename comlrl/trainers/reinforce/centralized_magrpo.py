"""Centralised MAGRPO: ONE policy writes every role's part of a joint answer in one completion.

The roles' prompts (their formatters) go into one joint prompt built by a centralised adapter;
the policy samples K joint completions per prompt; each is split into role outputs for the task's
reward (called with one list per role); the policy learns from its joint completions with the
MAGRPO loss. ``num_agents`` counts the roles; one model trains.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ...engine.prompts import build_formatter_list
from ...engine.roles import RoleReward, RoleSplit
from ...exceptions import ConfigError
from .config import CentralizedMAGRPOConfig
from .magrpo import MAGRPOTrainer

__all__ = ["CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer"]


class CentralizedMAGRPOTrainer(MAGRPOTrainer):
    """MAGRPO for a single joint policy of ``num_agents`` roles.

    Args:
        centralized_adapter: builds the joint prompt and splits joint completions (e.g.
            :class:`comlrl.trainers.preference.TaggedCentralizedComparatorAdapter`).
        num_agents: the number of roles; must equal ``args.num_agents``.
        agents: a list with exactly one model (name or loaded), or None with ``agent_model``.
        tokenizer: the actor's tokenizer (or a one-element list).
        reward_func: the task's reward, one completions list per role.
        formatters: the roles' formatters (one, or one per role).
        args: a :class:`CentralizedMAGRPOConfig`.
        **kwargs: the other :class:`MAGRPOTrainer` arguments (``agent_model``, ``train_dataset``, ...).
    """

    config_class = CentralizedMAGRPOConfig

    def __init__(self, *, centralized_adapter: Any, num_agents: int = 2, agents: Optional[Sequence[Any]] = None,
                 tokenizer: Any = None, reward_func: Optional[Callable[..., Any]] = None, formatters: Any = None,
                 args: Optional[CentralizedMAGRPOConfig] = None, **kwargs: Any):
        args = args if args is not None else CentralizedMAGRPOConfig(num_agents=num_agents)
        if getattr(args, "collaboration_mode", None) != "centralized":
            raise ConfigError("CentralizedMAGRPOTrainer needs a CentralizedMAGRPOConfig (centralized "
                              "collaboration), got " + type(args).__name__ + ".")
        if num_agents != args.num_agents:
            raise ConfigError(f"num_agents must match args.num_agents (the role count): {num_agents} vs "
                              f"{args.num_agents}.")
        if agents is not None and len(agents) != 1:
            raise ConfigError(f"a centralized run trains exactly one actor (one joint policy); got {len(agents)} "
                              "agents. Pass agents=[model] or agent_model=...")
        if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != 1:
            raise ConfigError(f"a centralized run has one actor, so one tokenizer; got {len(tokenizer)}.")
        self.num_roles = num_agents
        self._roles = RoleSplit(centralized_adapter, build_formatter_list(formatters, num_agents))
        self.centralized_adapter = centralized_adapter
        super().__init__(agents=agents, num_agents=1, tokenizer=tokenizer, reward_func=reward_func,
                         formatters=self._roles.joint_prompt, args=args, **kwargs)
        self.reward = RoleReward(self.reward, self._roles)

    def _warn_count(self, count: int) -> None:
        """``args.num_agents`` counts roles here, the trainer one actor: nothing to warn about."""

    def _reward_arity(self) -> int:
        return self.num_roles

    def _eval_completions(self, turns, group: int) -> list[list[str]]:
        """``[role][turn]``: eval item ``group``'s joint completions split into the roles' outputs
        (evaluation plays one chain per item, so node ``group`` of every turn is that item's)."""
        row = self._table("eval").item(turns[0].nodes[group].index)
        split = [self._roles.split(turn.completions[0][group], row) for turn in turns]
        return [[outputs[r] for outputs in split] for r in range(self.num_roles)]

    def fingerprint_extra(self) -> dict[str, Any]:
        from ...checkpoint.fingerprint import callable_fingerprint

        return {**super().fingerprint_extra(), "num_roles": self.num_roles,
                "role_formatters": [callable_fingerprint(f.source) for f in self._roles.formatters],
                "adapter": type(self.centralized_adapter).__qualname__}

    def _run_config_extra(self) -> dict[str, Any]:
        return {**super()._run_config_extra(), "collaboration_mode": "centralized", "num_roles": self.num_roles,
                "num_actor_models": 1}
