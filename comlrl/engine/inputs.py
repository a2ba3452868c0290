"""Resolving what a trainer is given (model names or objects, tokenizers, devices, LoRA) into one
frozen record, with a clear error for every inconsistent combination.

Conventions are CoMLRL's: ``agent_model`` (one name, or for comlrl a model object too) for
homogeneous agents, or ``agents`` (names or loaded models); tokenizers are loaded from model names
when not given, and required for model objects; ``model_config`` holds loading options
(``dtype`` / ``torch_dtype``, ``attn_implementation``, ``model_kwargs``, ``special_tokens``).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from ..exceptions import ConfigError, TokenizerError
from .devices import DeviceScheduler, check_available
from .hub import load_pretrained

__all__ = ["ResolvedAgents", "resolve_agents", "agent_count", "model_kwargs", "infer_model_name", "eos_token_ids",
           "frozen_copies", "check_tokenizers_usable", "check_context", "distinct_modules", "wants_cuda"]

logger = logging.getLogger("comlrl")

Source = Any  # a model name / path, or a torch.nn.Module


@dataclass(frozen=True)
class ResolvedAgents:
    """The trained models of a run and what belongs to each."""

    models: tuple[torch.nn.Module, ...]
    tokenizers: tuple[Any, ...]
    devices: tuple[torch.device, ...]
    eos_token_ids: tuple[tuple[int, ...], ...]
    sources: tuple[Optional[str], ...]     # the name each model was loaded from (None: given loaded)
    model_name: Optional[str]


def infer_model_name(source: Any) -> Optional[str]:
    """A name for a model source: the string itself, or a loaded model's ``name_or_path`` / type."""
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    config = getattr(source, "config", None)
    for value in (getattr(config, "_name_or_path", None), getattr(config, "model_type", None)):
        if value:
            return str(value)
    return type(source).__name__


def model_kwargs(model_config: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments from a CoMLRL ``model_config``."""
    config = dict(model_config or {})
    nested = dict(config.get("model_kwargs") or {})
    kwargs = dict(nested)
    dtype = config.get("dtype", config.get("torch_dtype", nested.get("dtype", nested.get("torch_dtype"))))
    kwargs.pop("torch_dtype", None)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    if config.get("attn_implementation") is not None:
        kwargs["attn_implementation"] = config["attn_implementation"]
    return kwargs


def agent_count(agent_model: Any, agents: Optional[Sequence[Any]], num_agents: Optional[int],
                config_count: int) -> int:
    """How many agents: ``len(agents)``, else ``num_agents``, else the config's ``num_agents``."""
    if agent_model is None and agents is None:
        raise ConfigError("Either agent_model or agents must be provided: agent_model='name or path' (with "
                          "num_agents) for copies of one model, or agents=[...] with one model per agent.")
    if num_agents is not None and (isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1):
        raise ConfigError(f"num_agents must be an int >= 1, got {num_agents!r}.")
    if agents is None:
        return num_agents if num_agents is not None else config_count
    if isinstance(agents, (str, bytes)) or not isinstance(agents, Sequence) or not agents:
        raise ConfigError(f"agents must be a non-empty list of model names or models, got {agents!r:.80}.")
    expected = num_agents if num_agents is not None else (config_count if agent_model is not None else None)
    if expected is not None and len(agents) != expected:
        raise ConfigError(f"agents length ({len(agents)}) must match num_agents ({expected}).")
    return len(agents)


def _sources(agent_model: Any, agents: Optional[Sequence[Any]], count: int) -> list[Any]:
    if agents is None:
        if isinstance(agent_model, torch.nn.Module):
            return [agent_model] + [None] * (count - 1)  # copies made after loading checks
        if not isinstance(agent_model, (str, os.PathLike)):
            raise ConfigError(f"agent_model must be a model name, a local path or a loaded model, got "
                              f"{type(agent_model).__name__}.")
        return [str(agent_model)] * count
    if agent_model is not None:
        name = infer_model_name(agent_model)
        names = {infer_model_name(a) for a in agents}
        if names != {name}:
            raise ConfigError(f"agent_model {name!r} and agents {sorted(map(str, names))} conflict: when both are "
                              "given, every entry of agents must be that model. Pass only one of them.")
    for i, a in enumerate(agents):
        if not isinstance(a, (str, os.PathLike, torch.nn.Module)):
            raise ConfigError(f"agents[{i}] is a {type(a).__name__}, neither a model name nor a model.")
    return [str(a) if isinstance(a, os.PathLike) else a for a in agents]


def _load(sources: list[Any], model_config: Optional[Mapping[str, Any]]) -> list[torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    kwargs = model_kwargs(model_config)
    models: list[torch.nn.Module] = []
    seen: set[int] = set()
    for i, source in enumerate(sources):
        if source is None:  # a copy of agent_model given as a loaded model
            models.append(copy.deepcopy(models[0]))
            continue
        if isinstance(source, str):
            models.append(load_pretrained(AutoModelForCausalLM, source, "model", **kwargs))
            continue
        if id(source) in seen:
            # One object for two agents would have two optimizers step the same weights.
            logger.warning("comlrl: agents[%d] is the same model object as an earlier agent; it gets its own copy "
                           "(each agent trains its own weights).", i)
            source = copy.deepcopy(source)
        seen.add(id(source))
        models.append(source)
    return models


def _tokenizers(tokenizer: Any, sources: list[Any], count: int) -> list[Any]:
    if tokenizer is None:
        names = [s for s in sources if isinstance(s, str)]
        if len(names) != count:
            raise TokenizerError("Tokenizer(s) must be provided when agents are model objects: pass tokenizer=tok "
                                 "(shared) or tokenizer=[tok_agent0, tok_agent1, ...].")
        from transformers import AutoTokenizer

        loaded: dict[str, Any] = {}
        for name in names:  # agents loaded from one path share one tokenizer object
            if name not in loaded:
                loaded[name] = load_pretrained(AutoTokenizer, name, "tokenizer")
        return [loaded[name] for name in names]
    if isinstance(tokenizer, (list, tuple)):
        if len(tokenizer) != count:
            raise TokenizerError(f"tokenizers length ({len(tokenizer)}) must match the number of agents ({count}); "
                                 "pass one shared tokenizer or exactly one per agent.")
        return list(tokenizer)
    return [tokenizer] * count


def _check_tokenizer(i: int, tok: Any, model: torch.nn.Module) -> None:
    if getattr(tok, "eos_token_id", None) is None:
        raise TokenizerError(f"tokenizer for agent {i} has no eos_token; completions could never end. Set "
                             "tokenizer.eos_token (e.g. to the model's end-of-text token).")
    if getattr(tok, "pad_token_id", None) is None:
        logger.warning("comlrl: tokenizer for agent %d has no pad token; using its eos token %r.", i,
                       getattr(tok, "eos_token", None))
        tok.pad_token = tok.eos_token
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    try:
        size = len(tok)
    except TypeError:  # a minimal tokenizer object without __len__
        return
    if rows is not None and size > rows:
        raise TokenizerError(f"agent {i}'s tokenizer has {size} tokens but its model's embedding has only {rows} "
                             "rows: they do not belong together. Pass the matching tokenizer (one per agent: "
                             "tokenizer=[tok_a, tok_b, ...]).")


def check_context(models: Sequence[torch.nn.Module], max_new_tokens: int) -> None:
    """``max_new_tokens`` must fit every model's context window (completions that would run past the
    window with their prompt are cut there: see comlrl.rollout.transformers_loop.fit_context)."""
    for i, model in enumerate(models):
        config = getattr(model, "config", None)
        window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(window, int) and max_new_tokens > window:
            raise ConfigError(f"max_new_tokens={max_new_tokens} does not fit agent {i}'s context of {window} "
                              f"positions (prompt and completion together); set max_new_tokens below {window}.")


def check_tokenizers_usable(tokenizers: Sequence[Any]) -> None:
    """Before sampling: every tokenizer can encode and decode (construction accepts minimal ones)."""
    for i, tok in enumerate(tokenizers):
        if not callable(tok) or not hasattr(tok, "batch_decode"):
            raise TokenizerError(f"tokenizer for agent {i} is a {type(tok).__name__}, not a transformers tokenizer "
                                 "(it must encode prompts and batch_decode completions).")


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return tuple(sorted(int(i) for i in ids if i is not None))


def _special_tokens(model_config: Optional[Mapping[str, Any]], tokenizers: list[Any],
                    models: list[torch.nn.Module]) -> None:
    """``model_config["special_tokens"]``: add them to each tokenizer, and grow the embeddings of
    its models when the vocabulary outgrows them."""
    special = (model_config or {}).get("special_tokens")
    if not special:
        return
    for tok in {id(t): t for t in tokenizers}.values():
        tok.add_special_tokens(dict(special))
    for tok, model in zip(tokenizers, models):
        rows = model.get_input_embeddings().num_embeddings
        if len(tok) > rows:
            model.resize_token_embeddings(len(tok))


def resolve_agents(agent_model: Any, agents: Optional[Sequence[Any]], count: int, tokenizer: Any,
                   model_config: Optional[Mapping[str, Any]], agent_devices: Any, peft_config: Any = None,
                   seed: int = 0) -> ResolvedAgents:
    """Load or take the agents, their tokenizers and devices (see the module docstring)."""
    if peft_config is not None:
        models, sources = _lora_agents(agent_model, agents, count, model_config, peft_config, seed)
    else:
        sources = _sources(agent_model, agents, count)
        models = _load(sources, model_config)
    tokenizers = _tokenizers(tokenizer, list(sources), count)
    _special_tokens(model_config, tokenizers, models)
    for i, (tok, model) in enumerate(zip(tokenizers, models)):
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"agents[{i}] is a {type(model).__name__}, not a model.")
        _check_tokenizer(i, tok, model)
    devices = [check_available(d, "agent_devices")
               for d in DeviceScheduler.resolve_devices(agent_devices, count, kind="agent_devices")]
    _place(models, devices)
    name = infer_model_name(agent_model if agent_model is not None else (agents or [None])[0])
    return ResolvedAgents(tuple(models), tuple(tokenizers), tuple(devices),
                          tuple(eos_token_ids(m, t) for m, t in zip(models, tokenizers)),
                          tuple(s if isinstance(s, str) else None for s in sources), name)


def _lora_agents(agent_model: Any, agents: Any, count: int, model_config: Any, peft_config: Any, seed: int):
    from ..adapters import build_lora_agents
    from ..checkpoint.rng import set_seed

    if agents is not None:
        raise ConfigError("peft_config makes the agents LoRA adapters on one shared base: pass agent_model=<path or "
                          "model> and num_agents instead of agents=[...].")
    if isinstance(agent_model, torch.nn.Module):
        base = agent_model
    else:
        from transformers import AutoModelForCausalLM

        base = load_pretrained(AutoModelForCausalLM, str(agent_model), "model", **model_kwargs(model_config))
    set_seed(seed)  # adapters initialised from the run's seed
    source = None if isinstance(agent_model, torch.nn.Module) else str(agent_model)
    return build_lora_agents(base, peft_config, count), [source] * count


def _place(models: list[torch.nn.Module], devices: list[torch.device]) -> None:
    from ..adapters import AdapterAgent

    shared: dict[int, torch.device] = {}
    for model, device in zip(models, devices):
        if isinstance(model, AdapterAgent) and shared.setdefault(id(model.shared), device) != device:
            raise ConfigError(f"LoRA agents share one base model, so they run on one device; agent_devices puts "
                              f"them on {shared[id(model.shared)]} and {device}. Give them the same device, or train "
                              "full models to spread agents over devices.")
    for model, device in zip(models, devices):
        model.to(device)


def frozen_copies(models: Sequence[torch.nn.Module], devices: Sequence[torch.device],
                  dtype: Optional[torch.dtype] = None) -> list[Optional[torch.nn.Module]]:
    """Each model's initial policy, frozen, for a KL penalty: a deep copy on its device (its
    parameters cast to ``dtype`` when given: mixed precision keeps the reference in the compute
    dtype, as it never trains), or None for a LoRA agent (its base with adapters disabled is its
    initial policy: no copy)."""
    from ..adapters import AdapterAgent, starts_at_base
    from ..rollout.compute import ComputeCopy, wants_compute_copy

    out: list[Optional[torch.nn.Module]] = []
    for model, device in zip(models, devices):
        if isinstance(model, AdapterAgent):
            if not starts_at_base(model):
                raise ConfigError("a reference KL with LoRA agents takes the base model (adapters disabled) as each "
                                  "agent's initial policy, but these adapters do not start at the base (their LoRA "
                                  "B matrices are not zero). Use peft's default init, or reference_kl_enabled=False.")
            out.append(None)
            continue
        frozen = ComputeCopy(model, dtype).module if wants_compute_copy(model, dtype) is None else copy.deepcopy(model)
        out.append(frozen.to(device).eval().requires_grad_(False))
    return out


def distinct_modules(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Modules every process must start equal (rank 0's); a LoRA base once with every adapter."""
    from ..adapters import AdapterAgent
    from ..models.actor_critic import unwrap_policy

    out, shared = [], {}
    for m in models:
        inner = unwrap_policy(m)
        if isinstance(inner, AdapterAgent):
            shared.setdefault(id(inner.shared), inner.shared)
            if inner is not m:  # a value head beside the adapter
                out.extend(c for n, c in m.named_children() if n != "model")
        else:
            out.append(m)
    return out + list(shared.values())


def wants_cuda(spec: Any, count: int) -> bool:
    """Whether the agents will train on CUDA (the process group then uses NCCL)."""
    from .devices import DeviceScheduler

    return any(d.type == "cuda" for d in DeviceScheduler.resolve_devices(spec, count, kind="agent_devices"))
