"""MAAC: multi-agent actor-critic with one centralised critic. The critic reads every agent's
prompt (``critic_type="v"``) or every prompt and the joint answer (``"q"``) as one text, and its
value is the baseline of every agent.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ...engine import distributed as dist
from ...engine.state import PlayedBuffer
from ...engine.step import concat_rollouts, select_rows
from ...exceptions import ConfigError
from ...functional.logprobs import final_hidden_states
from ...functional.values import value_errors
from ...models.actor_critic import CausalLMWithValueHead
from ...rollout import Rollout, left_pad
from .ac_base import ActorCriticTrainerBase, RolloutSample, _Losses, head_values
from .buffers import MAACBufferData
from .config import MAACConfig
from .critics import (as_value_model, check_critic_vocab, critic_device_list, critic_sources, load_critics,
                      lora_critics)

__all__ = ["MAACConfig", "MAACTrainer", "RolloutSample", "joint_critic_text"]


def joint_critic_text(prompts: Sequence[str], completions: Optional[Sequence[str]] = None) -> str:
    """The centralised critic's input (CoMLRL's layout): each agent's prompt as ``[Agent i] ...``,
    and for an action value ``[Joint Action]`` followed by each ``[Agent i action]``."""
    parts = [f"[Agent {i}] {p}" for i, p in enumerate(prompts)]
    if completions is not None:
        parts.append("[Joint Action]")
        parts += [f"[Agent {i} action]\n{c}" for i, c in enumerate(completions)]
    return "\n\n".join(parts)


def _text(prompt: Any) -> str:
    """A prompt as text (chat messages: their contents, one per line)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) if isinstance(m, Mapping) else str(m) for m in prompt)


class MAACTrainer(ActorCriticTrainerBase):
    """Multi-agent actor-critic (one centralised critic) for N cooperating causal LMs.

    Args: as :class:`~comlrl.trainers.actor_critic.IACTrainer`, except that ``critic_model`` /
    ``critics`` give the ONE critic (``critics=[model]``), required (or, with ``peft_config``,
    a LoRA critic on the agents' base). The critic reads the first agent's tokenizer's tokens.
    """

    config_class = MAACConfig
    algorithm_name = "MAAC"
    buffer_data_class = MAACBufferData

    @property
    def critic_optimizer(self) -> torch.optim.Optimizer:
        """The critic's AdamW (CoMLRL's name)."""
        return self.critic_optimizers[0]

    # --- construction ----------------------------------------------------------------------------
    def _early_checks(self, count: int) -> None:
        critic_model, critics, peft_config = self._critic_inputs
        if critic_model is None and critics is None and peft_config is None:
            raise ConfigError("Either critic_model or critics must be provided for MAAC: its one centralised critic "
                              "(critic_model='name or path', or critics=[model]).")
        if critic_model is not None or critics is not None:
            self._critic_sources = critic_sources(critic_model, critics, 1, "1 critic (MAAC has one centralised "
                                                                            "critic)")

    def _build_critics(self, actors, resolved, critic_model, critics, peft_config) -> list[CausalLMWithValueHead]:
        hidden = self.args.critic_value_head_hidden_dim
        if hidden is None:
            hidden = self.model_config.get("critic_value_head_hidden_dim")
        if critic_model is None and critics is None:
            critic = lora_critics(actors, 1, peft_config, hidden)[0]
            self.critic_device = resolved.devices[0]
            return [critic]
        model = load_critics(self._critic_sources, self.model_config, resolved.models)[0]
        self.critic_device = critic_device_list(self.args.critic_devices, 1, resolved.devices[:1])[0]
        critic = as_value_model(model, hidden).to(self.critic_device)
        check_critic_vocab(critic, resolved.tokenizers[0], "the MAAC critic")
        return [critic]

    def _critic_names(self) -> list[str]:
        return ["critic"]

    # --- values and the update ---------------------------------------------------------------------
    def _critic_inputs_of(self, turn: Any) -> Rollout:
        """The critic's left-padded token rows of a turn, one per row of the agents' rollouts."""
        k, q = self.args.num_generations, self.args.critic_type == "q"
        tokenizer = self.tokenizers[0]
        texts = []
        for r in range(len(turn.rollouts[0].texts)):
            node = turn.nodes[r // k]
            prompts = [_text(p) for p in node.prompts]
            texts.append(joint_critic_text(prompts, [ro.texts[r] for ro in turn.rollouts] if q else None))
        config = self.critics[0].config
        window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        rows = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        if isinstance(window, int):
            rows = [ids[-window:] for ids in rows]  # keep the end: the joint answer and the last prompts
        ids, mask = left_pad(rows, tokenizer.pad_token_id, self.critic_device)
        empty = torch.zeros(len(rows), 0, dtype=torch.long, device=ids.device)
        return Rollout(ids, mask, empty, empty.bool(), torch.zeros(len(rows), dtype=torch.long), texts)

    def _critic_values(self, inputs: Rollout) -> torch.Tensor:
        critic = self.critics[0]
        critic.eval()
        with self.autocast():
            hidden = final_hidden_states(critic.model, inputs.prompt_ids, inputs.prompt_mask)
        last = torch.full((hidden.shape[0],), hidden.shape[1] - 1, dtype=torch.long)
        return head_values(critic, hidden, last)

    def _turn_values(self, turn: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        inputs = self._critic_inputs_of(turn)
        values = self._critic_values(inputs)
        return [values] * self.num_agents, {"critic_inputs": inputs}

    def _critic_backward(self, buffer: PlayedBuffer[MAACBufferData], groups: range) -> list[_Losses]:
        """One regression of the critic on the step's joint rows, towards the agents' mean TD target
        (the agents' targets differ only by per-agent rewards or KL penalties)."""
        data, parts, targets, old = buffer.data, [], [], []
        for t, turn in enumerate(buffer.turns):
            rows = self._row_index(turn, groups)
            if not len(rows):
                continue
            parts.append(select_rows(data.critic_inputs[t], rows))
            targets.append(torch.stack([data.targets[a][t][rows] for a in range(self.num_agents)]).mean(dim=0))
            old.append(data.values[0][t][rows])
        count = dist.all_reduce_sum([sum(len(p.texts) for p in parts)], self.dist)[0]
        out = _Losses()
        if not parts:
            return [out]
        inputs = concat_rollouts(parts, self.tokenizers[0].pad_token_id)
        target, old_values = torch.cat(targets), torch.cat(old)
        mb = self.args.micro_batch_size or len(target)
        for start in range(0, len(target), mb):
            piece = select_rows(inputs, torch.arange(start, min(start + mb, len(target))))
            values = self._critic_values(piece)
            errors = value_errors(values, old_values[start:start + mb].to(values.device),
                                  target[start:start + mb].to(values.device), None)
            loss = errors.sum() / max(count, 1.0)
            (self.args.value_loss_coef * loss).backward()
            out.value += float(loss.detach())
        return [out]

    # --- export ----------------------------------------------------------------------------------
    def _exported(self) -> list[tuple[str, torch.nn.Module, Any]]:
        """``agent_i`` for the actors and ``critic`` (with its value head) for the critic (CoMLRL's
        layout)."""
        out = [(f"agent_{i}", m, t) for i, (m, t) in enumerate(zip(self.agents, self.tokenizers))]
        return out + [("critic", self.critics[0], self.tokenizers[0])]
