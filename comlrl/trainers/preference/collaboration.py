"""Centralised collaboration in the preference trainers: ONE actor writes every role's part.

:class:`CentralizedCollaboration` is the actor's formatter (the joint prompt) and its reward
function (each joint completion is split into role outputs, which the task's reward scores as if
N agents had answered). Names and call conventions are CoMLRL 1.4.3's.
"""

from __future__ import annotations

import copy

import torch
from typing import Any, Callable, Mapping, Optional, Sequence

from ...engine.prompts import build_formatter_list
from ...engine.rewards import RewardFunction
from ...engine.roles import RoleSplit
from ...exceptions import RewardError
from ...utils.reward_utils import resolve_reward_range

__all__ = ["CentralizedCollaboration", "joint_sequence_log_prob"]


class CentralizedCollaboration(RoleSplit):
    """The joint prompt and the role-split reward of one actor playing ``num_roles`` roles.

    Args:
        adapter: ``build_prompt(item, role_prompts)`` / ``parse_completion(text, item, n)`` (e.g.
            :class:`TaggedCentralizedComparatorAdapter`).
        formatters: the roles' formatters (one shared or one per role).
        reward_func: the task's reward, one completions list per role.
        num_roles: N.
    """

    def __init__(self, adapter: Any, formatters: Any, reward_func: Callable[..., Any], num_roles: int):
        super().__init__(adapter, build_formatter_list(formatters, num_roles))
        self.reward_func = reward_func
        self.reward_range = resolve_reward_range(reward_func)
        self._reward = RewardFunction(reward_func, num_roles)

    def build_prompt(self, item: Mapping[str, Any]) -> str:
        """The actor's prompt for ``item`` (its formatter)."""
        return self.joint_prompt(item)

    def __call__(self, completions: Sequence[str], *, prompts: Optional[Sequence[Any]] = None,
                 batch_items: Optional[Sequence[Mapping[str, Any]]] = None) -> list[float]:
        """Joint rewards of joint completions of one task item (the actor's reward function)."""
        if not batch_items:
            raise RewardError("centralized task rewards need batch_items (the dataset row of the completions).")
        if len(batch_items) not in (1, len(completions)):
            raise RewardError(f"{len(completions)} centralized completions for {len(batch_items)} batch_items; give "
                              "one row, or one per completion.")
        out: list[float] = []
        groups = [(batch_items[0], list(completions))] if len(batch_items) == 1 else \
            [(item, [c]) for item, c in zip(batch_items, completions)]
        for item, texts in groups:
            split = [self.split(str(text), item) for text in texts]
            per_role = [[outputs[r] for outputs in split] for r in range(self.num_roles)]
            out.extend(float(r) for r in self._reward(per_role, self.role_prompt(item, 0), item))
        return out

    def split_eval(self, joint_turns: Sequence[Sequence[str]], items: Sequence[Mapping[str, Any]]
                   ) -> list[list[list[str]]]:
        """``[role][item][turn]`` role outputs of one-turn joint evaluation completions."""
        if len(joint_turns) != 1 or len(joint_turns[0]) != len(items):
            raise RewardError("centralized evaluation outputs must align with the items (one turn, one completion "
                              "per item).")
        split = [self.split(str(c), item) for c, item in zip(joint_turns[0], items)]
        return [[[outputs[r]] for outputs in split] for r in range(self.num_roles)]

    def wrap_metrics_callback(self, callback: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``callback`` seeing one sample per role (``agent_idx`` = the role, ``completion`` = its
        output) instead of the joint sample; the originals are not changed."""
        def per_role(samples: list[Any]) -> Any:
            expanded = []
            for sample in samples:
                item = sample.metadata["batch_item"]
                for role, text in enumerate(self.split(str(sample.completion), item)):
                    view = copy.copy(sample)
                    view.agent_idx, view.completion = role, text
                    expanded.append(view)
            return callback(expanded)
        return per_role


def joint_sequence_log_prob(agent: torch.nn.Module, tokenizer: Any, prompt_ids: torch.Tensor,
                            completion_ids: torch.Tensor) -> torch.Tensor:
    """The log-probability of one completion (every token up to its first pad, that pad included
    when it is the EOS) after one prompt, as a differentiable scalar (CoMLRL's helper). The model
    runs in whatever train / eval mode it is in.

    Args:
        prompt_ids: ``[P]`` the prompt's token ids (non-empty).
        completion_ids: ``[T]`` the completion's ids, possibly padded.
    """
    from ...models.actor_critic import unwrap_policy

    model = unwrap_policy(agent)
    device = next(model.parameters()).device
    prompt = prompt_ids.detach().clone().reshape(-1).to(device)
    tokens = completion_ids.detach().clone().reshape(-1).to(device)
    if not len(prompt):
        raise ValueError("joint_sequence_log_prob needs a non-empty tokenized prompt.")
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is not None:
        at = (tokens == pad).nonzero()
        if len(at):
            end = int(at[0]) + (1 if pad == eos else 0)
            tokens = tokens[:end]
    if not len(tokens):
        return torch.zeros((), device=device, requires_grad=True)
    inputs = torch.cat([prompt, tokens[:-1]])[None]
    logits = model(input_ids=inputs, use_cache=False).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1).gather(1, tokens[:, None]).sum()
