"""A causal LM with a scalar value head: the actor (and critic) models of the actor-critic trainers.

    model = CausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(path))
    out = model(input_ids=ids, attention_mask=mask)
    out.logits            # [B, T, V] the language model's
    out.values            # [B, T]    the value head on the last layer's hidden state, every position
    model.save_pretrained("critic")                       # backbone + value_head.safetensors
    critic = CausalLMWithValueHead.from_pretrained("critic")

Names and signatures are CoMLRL 1.4.3's (``comlrl.models.actor_critic``). Added here:
``save_pretrained`` / ``from_pretrained`` (the head travels with the backbone, in safetensors),
``config`` and ``get_input_embeddings`` of the backbone, and a forward that asks the backbone for
its hidden states only when values are wanted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..exceptions import ConfigError

__all__ = ["ActorCriticOutput", "ValueHead", "CausalLMWithValueHead", "VALUE_HEAD_FILE", "VALUE_HEAD_CONFIG"]

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_CONFIG = "value_head.json"
_LEGACY_HEAD_FILE = "value_head.pt"  # what CoMLRL 1.4.3's save_model writes (a pickled state dict)


@dataclass
class ActorCriticOutput:
    """What :meth:`CausalLMWithValueHead.forward` returns.

    Attributes:
        logits: ``[B, T, V]`` the backbone's logits.
        values: ``[B, T]`` one value per position, or None (``output_values=False`` or no head).
        hidden_states: with values, the last layer's hidden states ``[B, T, H]``; otherwise
            whatever the backbone returned (its tuple of layers when asked for it, else None).
        past_key_values: the backbone's cache, passed through.
    """

    logits: torch.Tensor
    values: Optional[torch.Tensor]
    hidden_states: Optional[Any]
    past_key_values: Optional[Any]


class ValueHead(torch.nn.Module):
    """A scalar head on hidden states: ``Linear(H, 1)``, or ``Linear(H, hidden) -> tanh -> Linear(hidden, 1)``
    when ``hidden_dim`` is a positive int (None or 0: no hidden layer).

    Weights start from N(0, 0.02), biases at zero. ``forward(hidden [..., H]) -> [..., 1]``.
    """

    def __init__(self, input_dim: int, hidden_dim: Optional[int] = None):
        super().__init__()
        if isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1:
            raise ConfigError(f"ValueHead input_dim must be a positive int (the backbone's hidden size), got "
                              f"{input_dim!r}.")
        if hidden_dim is not None and (isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int)
                                       or hidden_dim < 0):
            raise ConfigError(f"value head hidden_dim must be None, 0 (no hidden layer) or a positive int, got "
                              f"{hidden_dim!r}.")
        self.input_dim, self.hidden_dim = input_dim, hidden_dim or None
        self.pre_projection: Optional[torch.nn.Sequential] = None
        width = input_dim
        if self.hidden_dim:
            self.pre_projection = torch.nn.Sequential(torch.nn.Linear(input_dim, self.hidden_dim), torch.nn.Tanh())
            width = self.hidden_dim
        self.value_projection = torch.nn.Linear(width, 1)
        for module in self.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                torch.nn.init.zeros_(module.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(self.value_projection.weight.dtype)
        if self.pre_projection is not None:
            x = self.pre_projection(x)
        return self.value_projection(x)


def hidden_size_of(model: torch.nn.Module) -> int:
    """The width of a backbone's hidden states (``config.hidden_size``, or GPT-2's ``n_embd``)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"{type(model).__name__} has no config; a value head needs a transformers model whose "
                          "config gives the hidden size.")
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not isinstance(size, int):
        raise ConfigError(f"{type(model).__name__}'s config has neither hidden_size nor n_embd; cannot size a "
                          "value head for it.")
    return size


class CausalLMWithValueHead(torch.nn.Module):
    """A transformers causal LM (``model``) and an optional :class:`ValueHead` (``value_head``).

    Args:
        base_model: the backbone (a ``PreTrainedModel``, or a comlrl LoRA agent).
        value_head_hidden_dim: hidden width of the head (None: a single linear layer).
        attach_value_head: False: no head (an actor whose values come from a separate critic).

    The head is created in the backbone's dtype and on its device. State-dict keys are
    ``model.*`` and ``value_head.*``.
    """

    def __init__(self, base_model: torch.nn.Module, value_head_hidden_dim: Optional[int] = None,
                 attach_value_head: bool = True):
        super().__init__()
        if not isinstance(base_model, torch.nn.Module):
            raise ConfigError(f"CausalLMWithValueHead wraps a model, got {type(base_model).__name__}.")
        self.model = base_model
        self.value_head: Optional[ValueHead] = None
        if attach_value_head:
            head = ValueHead(hidden_size_of(base_model), value_head_hidden_dim)
            first = next(iter(base_model.parameters()), None)
            if first is not None:
                head = head.to(device=first.device, dtype=first.dtype if first.is_floating_point() else None)
            self.value_head = head

    # --- what trainers and users read off the model --------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> Optional[torch.nn.Module]:
        return self.model.get_output_embeddings()

    # --- running ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = None, output_values: bool = True, **kwargs: Any) -> ActorCriticOutput:
        """The backbone's forward, plus values ``[B, T]`` from the last layer's hidden states when
        ``output_values`` and the model has a head."""
        want_values = output_values and self.value_head is not None
        if want_values:
            kwargs["output_hidden_states"] = True
        if past_key_values is not None:  # passed on only when given (transformers renames it to `cache`)
            kwargs["past_key_values"] = past_key_values
        if use_cache is not None:
            kwargs["use_cache"] = use_cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         return_dict=True, **kwargs)
        hidden: Any = getattr(out, "hidden_states", None)
        values = None
        if want_values:
            hidden = hidden[-1]
            values = self.value_head(hidden).squeeze(-1)
        return ActorCriticOutput(logits=out.logits, values=values, hidden_states=hidden,
                                 past_key_values=_cache_of(out))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The backbone's ``generate``."""
        return self.model.generate(*args, **kwargs)

    # --- saving and loading --------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, **kwargs: Any) -> Path:
        """Write the backbone (``save_pretrained``) and, with a head, ``value_head.safetensors`` +
        ``value_head.json`` (and ``value_head.pt``, the file CoMLRL 1.4.3's docs load with
        ``torch.load``: a plain tensor dict, loadable with ``weights_only=True``)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, **kwargs)
        if self.value_head is not None:
            state = {k: v.detach().to("cpu").contiguous() for k, v in self.value_head.state_dict().items()}
            save_file(state, str(directory / VALUE_HEAD_FILE))
            torch.save(state, directory / _LEGACY_HEAD_FILE)
            (directory / VALUE_HEAD_CONFIG).write_bytes(self._head_config())
        return directory

    def _head_config(self) -> bytes:
        return (json.dumps({"input_dim": self.value_head.input_dim, "hidden_dim": self.value_head.hidden_dim})
                + "\n").encode("utf-8")

    def checkpoint_parts(self) -> dict[str, torch.nn.Module]:
        """How a checkpoint stores it (:mod:`comlrl.engine.layouts`): the backbone as a model
        folder and the head beside it, the files :meth:`from_pretrained` reads."""
        return {"model": self.model, **({"value_head": self.value_head} if self.value_head is not None else {})}

    def checkpoint_sidecars(self) -> dict[str, bytes]:
        return {VALUE_HEAD_CONFIG: self._head_config()} if self.value_head is not None else {}

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs: Any) -> "CausalLMWithValueHead":
        """Load what :meth:`save_pretrained` wrote (``kwargs`` go to the backbone's
        ``AutoModelForCausalLM.from_pretrained``). A directory without a value head gives a model
        with a fresh head."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        directory = Path(directory)
        backbone = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        config_path = directory / VALUE_HEAD_CONFIG
        hidden = json.loads(config_path.read_text()).get("hidden_dim") if config_path.exists() else None
        model = cls(backbone, value_head_hidden_dim=hidden)
        head_path = directory / VALUE_HEAD_FILE
        if head_path.exists():
            state = load_file(str(head_path))
            try:
                model.value_head.load_state_dict(state)
            except RuntimeError as exc:
                raise ConfigError(f"{head_path} does not fit this backbone's value head: {exc}") from None
        return model


def _cache_of(output: Any) -> Any:
    """The KV cache of a transformers output, read by key: transformers 5 calls it ``cache`` and
    warns on the deprecated ``past_key_values`` attribute."""
    if hasattr(output, "keys"):
        return output["cache"] if "cache" in output else output.get("past_key_values")
    return getattr(output, "past_key_values", None)


def unwrap_policy(model: torch.nn.Module) -> torch.nn.Module:
    """The language model of an actor: the backbone of a :class:`CausalLMWithValueHead`."""
    return model.model if isinstance(model, CausalLMWithValueHead) else model
