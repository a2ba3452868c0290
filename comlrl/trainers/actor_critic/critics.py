"""Resolving the models of an actor-critic run: actors with or without value heads, critics given as
names, models or :class:`CausalLMWithValueHead`, their devices, and LoRA critics on the agents' base."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Mapping, Optional, Sequence

import torch

from ...engine.inputs import model_kwargs
from ...exceptions import ConfigError
from ...models.actor_critic import CausalLMWithValueHead, unwrap_policy
from ...engine.devices import DeviceScheduler, check_available

__all__ = ["split_value_heads", "critic_sources", "load_critics", "as_value_model", "critic_device_list",
           "check_critic_vocab", "lora_critics"]

logger = logging.getLogger("comlrl")


def split_value_heads(agent_model: Any, agents: Optional[Sequence[Any]]) -> tuple[Any, Optional[list], list]:
    """Actors given as :class:`CausalLMWithValueHead` become their backbones (what the engine loads,
    places and samples with); their heads are returned to be put back. Returns ``(agent_model,
    agents, heads)`` with ``heads[i]`` the head of agent i (None: build one if needed)."""
    heads: list[Any] = []
    if isinstance(agent_model, CausalLMWithValueHead):
        heads.append(agent_model.value_head)
        agent_model = agent_model.model
    if agents is not None and not isinstance(agents, (str, bytes)) and isinstance(agents, Sequence):
        heads = [a.value_head if isinstance(a, CausalLMWithValueHead) else None for a in agents]
        agents = [a.model if isinstance(a, CausalLMWithValueHead) else a for a in agents]
    return agent_model, agents, heads


def critic_sources(critic_model: Any, critics: Optional[Sequence[Any]], count: int, label: str) -> list[Any]:
    """One critic source per critic: ``critics`` (checked to hold ``count``), else ``critic_model``
    repeated ``count`` times."""
    if critics is None:
        return [str(critic_model) if isinstance(critic_model, os.PathLike) else critic_model] * count
    if isinstance(critics, (str, bytes, os.PathLike)) or not isinstance(critics, Sequence) or not critics:
        raise ConfigError(f"critics must be a non-empty list of model names or models, got {critics!r:.80}.")
    if len(critics) != count:
        raise ConfigError(f"critics length ({len(critics)}) must match {label}.")
    if critic_model is not None:
        raise ConfigError("pass critic_model or critics, not both.")
    for i, c in enumerate(critics):
        if c is None or not isinstance(c, (str, os.PathLike, torch.nn.Module)):
            raise ConfigError(f"critics[{i}] is a {type(c).__name__}, neither a model name nor a model.")
    return [str(c) if isinstance(c, os.PathLike) else c for c in critics]


def load_critics(sources: list[Any], model_config: Optional[Mapping[str, Any]], taken: Sequence[torch.nn.Module]
                 ) -> list[torch.nn.Module]:
    """Load names (``model_config["critic_model_kwargs"]`` as loading options) and take model
    objects. A model object already used (by an actor, or an earlier critic) gets its own copy:
    one set of weights stepped by two optimizers would be two roles fighting over it."""
    from transformers import AutoModelForCausalLM

    config = dict(model_config or {})
    kwargs = model_kwargs({**config, "model_kwargs": config.get("critic_model_kwargs") or {}})
    seen = {id(m) for m in taken} | {id(unwrap_policy(m)) for m in taken}
    out: list[torch.nn.Module] = []
    for i, source in enumerate(sources):
        if isinstance(source, str):
            try:
                out.append(AutoModelForCausalLM.from_pretrained(source, **kwargs))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"Failed to load critic model from identifier {source!r}: {exc}") from exc
            continue
        inner = unwrap_policy(source)
        if id(source) in seen or id(inner) in seen:
            logger.info("comlrl: critic %d is a model object already used by another agent or critic; it gets its "
                        "own copy (each role trains its own weights).", i)
            source = copy.deepcopy(source)
        seen.update({id(source), id(unwrap_policy(source))})
        out.append(source)
    return out


def as_value_model(model: torch.nn.Module, hidden_dim: Optional[int]) -> CausalLMWithValueHead:
    """``model`` with a value head: a :class:`CausalLMWithValueHead` as it is (a head added if it has
    none), any other causal LM wrapped with a fresh head of ``hidden_dim``."""
    if isinstance(model, CausalLMWithValueHead):
        if model.value_head is None:
            model.value_head = CausalLMWithValueHead(model.model, hidden_dim).value_head
        return model
    return CausalLMWithValueHead(model, value_head_hidden_dim=hidden_dim, attach_value_head=True)


def critic_device_list(spec: Any, count: int, fallback: Sequence[torch.device]) -> list[torch.device]:
    """The critics' devices: ``critic_devices`` resolved for ``count`` critics, else ``fallback``."""
    if spec is None:
        return list(fallback)
    return [check_available(d, "critic_devices")
            for d in DeviceScheduler.resolve_devices(spec, count, kind="critic_devices")]


def check_critic_vocab(critic: torch.nn.Module, tokenizer: Any, who: str) -> None:
    """A critic reads token ids of ``tokenizer``: its embedding must have a row for every one."""
    embeddings = critic.get_input_embeddings() if hasattr(critic, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    try:
        size = len(tokenizer)
    except TypeError:  # a minimal tokenizer object: nothing to compare
        return
    if rows is not None and size > rows:
        raise ConfigError(f"{who} reads token ids of a tokenizer with {size} tokens, but its embedding has only {rows} "
                          "rows; give the critic the actor's vocabulary (the same model family).")


def lora_critics(actors: Sequence[torch.nn.Module], count: int, peft_config: Any, hidden_dim: Optional[int]
                 ) -> list[CausalLMWithValueHead]:
    """``count`` critics as LoRA adapters (``critic_0`` ...) on the shared base of LoRA actors, each
    with its own value head: the base model's weights are held once for every role."""
    from ...adapters import AdapterAgent, add_adapters

    policy = unwrap_policy(actors[0])
    if not isinstance(policy, AdapterAgent):
        raise ConfigError("LoRA critics live on the agents' LoRA base: pass peft_config (the agents' adapters) or "
                          "give critics=... / critic_model=...")
    adapters = add_adapters(policy.shared, peft_config, [f"critic_{i}" for i in range(count)])
    return [as_value_model(a, hidden_dim) for a in adapters]
