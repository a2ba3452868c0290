"""IAC: independent actor-critic. Each agent learns from its own critic: a separate model
(``use_separate_critic=True``, CoMLRL's default) or a value head on the agent itself, trained
together with it. ``critic_type="v"`` values the agent's prompt, ``"q"`` its prompt and completion.
"""

from __future__ import annotations

from typing import Any

import torch

from ...engine.step import AgentRows
from ...exceptions import ConfigError
from ...functional.logprobs import final_hidden_states, log_probs_and_hidden, sequence_log_probs
from ...functional.values import value_errors
from ...models.actor_critic import CausalLMWithValueHead
from ...rollout import Rollout
from .ac_base import ActorCriticTrainerBase, RolloutSample, _Losses, head_values, value_positions
from .config import IACConfig
from .critics import (as_value_model, check_critic_vocab, critic_device_list, critic_sources, load_critics,
                      lora_critics)

__all__ = ["IACConfig", "IACTrainer", "RolloutSample"]


class IACTrainer(ActorCriticTrainerBase):
    """Independent actor-critic for N cooperating causal LMs.

    Args (CoMLRL 1.4.3's, in its order):
        agent_model: a model name / local path (or a loaded model) copied into ``num_agents`` agents.
        critic_model: with ``use_separate_critic``: a model name (or model) copied into one critic
            per agent.
        tokenizer: one shared tokenizer or one per agent (critics read the agents' token ids).
        reward_func: ``f(completions1, ..., completionsN)`` -> one joint reward per joint action,
            or each agent's own (N values, or N lists of one value per joint action).
        reward_processor: ``float -> float`` applied to every reward.
        formatters: ``f(item[, external_prompts]) -> prompt``, one shared or one per agent.
        args: an :class:`IACConfig` (defaults if None).
        train_dataset, eval_dataset: rows with a ``prompt`` column (or any, given formatters).
        model_config: loading options (``dtype``, ``model_kwargs``, ``critic_model_kwargs``, ...).
        wandb_config: W&B settings; None = no W&B.
        metrics_callback: ``f(list[RolloutSample]) -> dict``: task metrics of each episode, logged
            (averaged) with the training rows and as ``eval/<key>`` in evaluation.
        external_transition: for ``num_turns > 1``: the agents' next prompts from a joint answer.
        agents: one model name / model / :class:`CausalLMWithValueHead` per agent.
        critics: one critic (name, model or :class:`CausalLMWithValueHead`) per agent.
        num_agents: how many agents ``agent_model`` makes (default ``args.num_agents``).
        peft_config: a ``peft.LoraConfig``: agents (and, without critics given, the critics) become
            LoRA adapters on one frozen base ``agent_model``.
    """

    config_class = IACConfig
    algorithm_name = "IAC"

    # --- construction ----------------------------------------------------------------------------
    def _check_critic_arguments(self, args: IACConfig, critic_model: Any, critics: Any) -> None:
        if not args.use_separate_critic and (critic_model is not None or critics is not None):
            raise ConfigError("critics can only be provided when use_separate_critic=True; with "
                              "use_separate_critic=False each agent is its own critic (a value head on it). Drop "
                              "critic_model/critics, or set use_separate_critic=True.")

    def _early_checks(self, count: int) -> None:
        critic_model, critics, peft_config = self._critic_inputs
        if not self.args.use_separate_critic:
            return
        if critic_model is None and critics is None and peft_config is None:
            raise ConfigError("use_separate_critic=True: Either critic_model or critics must be provided (critic_model="
                              "'name or path' for one critic per agent, or critics=[...] with one per agent); or set "
                              "use_separate_critic=False to give each agent a value head instead.")
        if critic_model is not None or critics is not None:
            self._critic_sources = critic_sources(critic_model, critics, count, f"num_agents ({count})")

    def _actor(self, model: torch.nn.Module) -> CausalLMWithValueHead:
        return CausalLMWithValueHead(model, value_head_hidden_dim=self.args.value_head_hidden_dim,
                                     attach_value_head=not self.args.use_separate_critic)

    def _build_critics(self, actors, resolved, critic_model, critics, peft_config) -> list[CausalLMWithValueHead]:
        args, count = self.args, len(actors)
        if not args.use_separate_critic:
            self.critic_devices = list(resolved.devices)
            return []
        hidden = args.critic_value_head_hidden_dim
        if critic_model is None and critics is None:  # LoRA critics on the agents' base
            built = lora_critics(actors, count, peft_config, hidden)
            self.critic_devices = list(resolved.devices)
            if args.critic_devices is not None and critic_device_list(args.critic_devices, count, []) != \
                    self.critic_devices:
                raise ConfigError("LoRA critics share the agents' base model and run on its device; drop "
                                  "critic_devices or give critics=... as separate models.")
            return built
        loaded = load_critics(self._critic_sources, self.model_config, resolved.models)
        self.critic_devices = critic_device_list(args.critic_devices, count, resolved.devices)
        built = []
        for i, (model, device) in enumerate(zip(loaded, self.critic_devices)):
            critic = as_value_model(model, hidden).to(device)
            check_critic_vocab(critic, resolved.tokenizers[i], f"critic {i}")
            built.append(critic)
        return built

    # --- values and the update ---------------------------------------------------------------------
    def _value_model(self, agent: int) -> CausalLMWithValueHead:
        return self.critics[agent] if self.args.use_separate_critic else self.agents[agent]

    def _values(self, agent: int, ro: Rollout) -> torch.Tensor:
        """``[R]`` values of agent ``agent``'s rows by its critic (with grad unless under no_grad):
        one padded forward of the prompts (``"v"``) or of prompt and completion (``"q"``)."""
        model = self._value_model(agent)
        model.eval()
        device = next(model.value_head.parameters()).device
        ids, mask = ro.prompt_ids.to(device), ro.prompt_mask.to(device)
        if self.args.critic_type == "q":
            ids = torch.cat([ids, ro.completion_ids.to(device)], dim=1)
            mask = torch.cat([mask, torch.ones_like(ro.completion_ids, device=device)], dim=1)
        with self.autocast():
            hidden = final_hidden_states(model.model, ids, mask)
        return head_values(model, hidden, value_positions(ro, self.args.critic_type))

    def _turn_values(self, turn: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return [self._values(a, ro) for a, ro in enumerate(turn.rollouts)], {}

    def _agent_value_loss(self, agent: int) -> bool:
        return True

    def _agent_backward(self, agent: int, rows: AgentRows, denominator: float) -> _Losses:
        """The agent's policy loss and its critic's value loss; with a value head on the agent, both
        from one forward pass (the value at the last prompt token, or the last completion token)."""
        args, actor = self.args, self.agents[agent]
        policy = actor.model
        policy.eval()
        separate = args.use_separate_critic
        out = _Losses()
        for piece in rows.micro_batches(args.micro_batch_size):
            ro = piece.rollout
            with self.autocast():
                if separate:
                    logp = sequence_log_probs(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                              args.temperature)
                else:
                    logp, hidden = log_probs_and_hidden(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                                        args.temperature)
            values = self._values(agent, ro) if separate else head_values(
                actor, hidden, value_positions(ro, args.critic_type))
            policy_loss = self._policy_loss(logp, piece, denominator)
            errors = value_errors(values, piece.extras["old_values"].to(values.device),
                                  piece.returns.to(values.device), args.value_clip_range)
            value_loss = errors.sum() / max(denominator, 1.0)
            if separate:  # on two devices, maybe: two backward passes (disjoint parameters)
                policy_loss.backward()
                (args.value_loss_coef * value_loss).backward()
            else:
                (policy_loss + args.value_loss_coef * value_loss).backward()
            out.policy += float(policy_loss.detach())
            out.value += float(value_loss.detach())
        return out

    # --- export ----------------------------------------------------------------------------------
    def _exported(self) -> list[tuple[str, torch.nn.Module, Any]]:
        """``agent_i`` (with ``value_head.safetensors`` when the agent is its own critic) and
        ``agent_i/critic`` for separate critics (CoMLRL's layout)."""
        out = [(f"agent_{i}", m, t) for i, (m, t) in enumerate(zip(self.agents, self.tokenizers))]
        out += [(f"agent_{i}/critic", c, self.tokenizers[i]) for i, c in enumerate(self.critics)]
        return out
