"""Several agents as LoRA adapters on one shared, frozen base model.

    base = AutoModelForCausalLM.from_pretrained(path)
    agents = build_lora_agents(base, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"), 2)
    optimizers = [torch.optim.AdamW(agent.parameters(), lr=1e-4) for agent in agents]
    logits = agents[0](input_ids=ids).logits            # base + agent_0's adapter
    with agents[0].reference():
        ref_logits = agents[0](input_ids=ids).logits    # the frozen base: the initial policy

One :class:`peft.PeftModel` holds the base weights once and one adapter per agent (``agent_0``,
``agent_1``, ...). Each :class:`AdapterAgent` is a view of that model: calling it activates its own
adapter first, and its ``parameters()`` / ``state_dict()`` are only its adapter's parameters (the
very ``Parameter`` objects the PeftModel computes with), so per-agent optimizers, gradient clipping
and ``safetensors.torch.save_model`` / ``load_model`` work as for separate models.

Why the adapter switch goes through this module: peft's ``set_adapter`` (0.21) sets
``requires_grad=False`` on every adapter but the active one, and ``disable_adapter()`` leaves only the
active one trainable on exit. Agent i's adapter would then be frozen whenever another agent ran last,
and a trainer that builds optimizers from ``[p for p in m.parameters() if p.requires_grad]`` would give
every agent but the last an empty optimizer. So after every switch every agent's adapter is made
trainable again with peft's own ``set_requires_grad``; an adapter that is not active takes no part
in the forward, so its gradients stay ``None`` whatever its flag says.

peft is optional: the ``peft`` extra (``pip install -e ".[peft]"`` in the checkout).
"""

from __future__ import annotations

from ._imports import require_torch

require_torch("comlrl.adapters")  # before the first torch import: say how to install it

import contextlib
import copy
import os
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ._imports import install_hint
from .exceptions import ConfigError
from .checkpoint.fingerprint import base_fingerprint, digest

__all__ = ["AdapterAgent", "build_lora_agents", "add_adapters", "base_fingerprint", "starts_at_base"]

_INSTALL_HINT = install_hint("peft")
# LoRA initialisations that subtract the adapter's initial product from the base weights.
_BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda", "eva")


def _import_peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - exercised only without peft installed
        raise ConfigError(f"LoRA agents need the optional package peft: {_INSTALL_HINT}") from exc
    return peft


# ------------------------------------------------------------------------------------------------
# building the agents
# ------------------------------------------------------------------------------------------------

def build_lora_agents(base: torch.nn.Module, peft_config: Any, num_agents: int) -> list["AdapterAgent"]:
    """Wrap ``base`` once and give it one adapter per agent.

    Args:
        base: a transformers causal LM (not yet a PeftModel). It is modified in place: peft injects
            the adapter layers into it and freezes its weights; use the returned agents from now on.
        peft_config: a ``peft.LoraConfig`` (or another non-prompt-learning ``PeftConfig``) for a causal
            LM. Each adapter gets its own deep copy; the caller's object is not modified.
        num_agents: number of agents (adapters ``agent_0`` .. ``agent_{N-1}``), at least 1.
    Returns:
        ``num_agents`` :class:`AdapterAgent` sharing one :class:`peft.PeftModel`. Adapters are
        initialised in order from torch's global RNG, so ``torch.manual_seed`` before the call makes
        them reproducible; with peft's default LoRA init (B = 0) every agent starts as the base.
    Raises:
        ConfigError: peft missing, wrong config type, bias training, no module matched, bad count.
    """
    peft = _import_peft()
    if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
        raise ConfigError(f"num_agents must be an integer >= 1; got {num_agents!r}.")
    if isinstance(base, peft.PeftModel):
        raise ConfigError("build_lora_agents wraps a plain transformers model, but base is already a PeftModel. "
                          "Pass the unwrapped model, or build AdapterAgent(peft_model, name) for each of its "
                          "adapters.")
    _check_peft_config(peft, peft_config)
    names = [f"agent_{i}" for i in range(num_agents)]
    try:
        with _quiet_peft():
            shared = peft.get_peft_model(base, copy.deepcopy(peft_config), adapter_name=names[0])
    except ValueError as exc:
        if type(exc).__name__ == "NoMatchingPeftModuleError" or "not found in the base model" in str(exc):
            raise ConfigError(_no_match_message(base, peft_config)) from exc
        raise
    for name in names[1:]:
        shared.add_adapter(name, copy.deepcopy(peft_config))
    agents = [AdapterAgent(shared, name) for name in names]
    _group(shared).activate(shared, names[0])
    return agents


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft (0.21) reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a
    model: a FutureWarning about peft's code that users can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def add_adapters(shared: torch.nn.Module, peft_config: Any, names: list[str]) -> list["AdapterAgent"]:
    """More adapters (e.g. critics) on the PeftModel of existing agents, one per name, each a deep copy
    of ``peft_config``, initialised in order from torch's global RNG."""
    peft = _import_peft()
    _check_peft_config(peft, peft_config)
    taken = [n for n in names if n in shared.peft_config]
    if taken:
        raise ConfigError(f"adapter name(s) {taken} already exist on this model; choose other names.")
    active = shared.active_adapter
    for name in names:
        shared.add_adapter(name, copy.deepcopy(peft_config))
    added = [AdapterAgent(shared, name) for name in names]
    _group(shared).activate(shared, active)
    return added


def _check_peft_config(peft, peft_config: Any) -> None:
    example = "peft.LoraConfig(r=8, lora_alpha=16, target_modules='all-linear', task_type='CAUSAL_LM')"
    if not isinstance(peft_config, peft.PeftConfig):
        raise ConfigError(f"peft_config must be a peft.LoraConfig (or another peft.PeftConfig); got "
                          f"{type(peft_config).__name__}. Build one, e.g. {example}"
                          + (", or peft.LoraConfig(**your_dict)." if isinstance(peft_config, dict) else "."))
    if peft_config.is_prompt_learning:
        raise ConfigError(f"{type(peft_config).__name__} is a prompt-learning method, which peft cannot hold as "
                          f"several adapters on one model; use an adapter method such as {example}.")
    task = getattr(peft_config, "task_type", None)
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ConfigError(f"peft_config.task_type is {task!r}; agents are causal LMs: use task_type='CAUSAL_LM' "
                          "(or leave it None).")
    init = getattr(peft_config, "init_lora_weights", True)
    if isinstance(init, str) and init.split("_")[0].lower() in _BASE_CHANGING_INITS:
        raise ConfigError(f"peft_config.init_lora_weights={init!r} rewrites the base weights when an adapter is "
                          "added, but all agents share one base: each agent's adapter would change it for the "
                          "others. Use the default init (init_lora_weights=True) or 'gaussian'.")
    bias = getattr(peft_config, "bias", "none")
    if bias != "none":
        raise ConfigError(f"peft_config.bias={bias!r} trains bias vectors of the base model, which all agents "
                          "share: one agent's update would change every agent. Use bias='none'.")


def starts_at_base(agent: "AdapterAgent") -> bool:
    """True if the agent's adapter adds nothing yet (every LoRA ``B`` matrix is zero, peft's default
    init), so that the base model with adapters disabled is the agent's initial policy."""
    found = False
    for name, param in agent.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            found = True
            if bool(param.detach().any()):
                return False
    return found


def _no_match_message(base: torch.nn.Module, peft_config: Any) -> str:
    linear = []
    for path, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            leaf = path.rpartition(".")[2]
            if leaf not in linear:
                linear.append(leaf)
    shown = ", ".join(linear[:12]) + (", ..." if len(linear) > 12 else "")
    return (f"peft_config.target_modules={peft_config.target_modules!r} matches no module of "
            f"{type(base).__name__}. Its linear layers are named: {shown or '(none found)'}. Set target_modules "
            f"to some of these (e.g. {linear[:2]!r}) or to 'all-linear' (every linear layer but the output head).")


# ------------------------------------------------------------------------------------------------
# per-model bookkeeping: which adapter parameters are trainable
# ------------------------------------------------------------------------------------------------

class _AdapterGroup:
    """Which adapters of one PeftModel train (holds no reference to it)."""

    def __init__(self) -> None:
        self.trainable: list[str] = []

    def register(self, shared: torch.nn.Module, name: str, params: list[torch.nn.Parameter]) -> None:
        # An adapter made with inference_mode stays frozen; every other one trains.
        if name not in self.trainable and not getattr(shared.peft_config[name], "inference_mode", False):
            self.trainable.append(name)
        self.restore(shared)

    def restore(self, shared: torch.nn.Module) -> None:
        """Every trainable adapter trainable again (peft's switches leave only the active one so)."""
        if self.trainable:
            shared.set_requires_grad(self.trainable, requires_grad=True)

    def activate(self, shared: torch.nn.Module, name: str) -> None:
        if shared.active_adapter != name:
            shared.set_adapter(name)  # peft freezes every other adapter: undone by restore()
            self.restore(shared)


_GROUPS: "weakref.WeakKeyDictionary[torch.nn.Module, _AdapterGroup]" = weakref.WeakKeyDictionary()


def _group(shared: torch.nn.Module) -> _AdapterGroup:
    group = _GROUPS.get(shared)
    if group is None:
        group = _GROUPS[shared] = _AdapterGroup()
    return group


def _adapter_parameters(shared: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """``(key, parameter)`` of one adapter; key = PEFT's file key (the adapter segment dropped)."""
    out = []
    for full, param in shared.named_parameters():
        parts = full.split(".")
        if name in parts:
            out.append((".".join(s for s in parts if s != name), param))
    return out


# ------------------------------------------------------------------------------------------------
# the agent
# ------------------------------------------------------------------------------------------------

class AdapterAgent(torch.nn.Module):
    """One agent: a shared PeftModel run with one named adapter.

    Calls (``agent(input_ids=..., attention_mask=..., position_ids=..., use_cache=..., logits_to_keep=...,
    cache=...)``) activate this adapter, then run the shared model; the output is the model's.

    Parameters and state: ``parameters()``, ``named_parameters()``, ``state_dict()``, ``load_state_dict()``,
    ``zero_grad()`` cover only this adapter. The parameters are the PeftModel's own objects; the keys
    are PEFT's adapter-file keys (e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
    no adapter name), identical for every agent and process, so agent i's state loads into agent j and
    the keys match ``adapter_model.safetensors``.

    Shared state: ``train()`` / ``eval()`` / ``training`` and ``to()`` / ``cuda()`` / ``half()`` act on
    the shared model, hence on every agent of that base at once. ``config``, ``generation_config``,
    ``get_input_embeddings()``, ``device`` and ``get_base_model()`` are the base model's.

    Args:
        shared: a ``peft.PeftModel`` that holds the adapter.
        adapter_name: the adapter of this agent (a key of ``shared.peft_config``).
    """

    def __init__(self, shared: torch.nn.Module, adapter_name: str):
        super().__init__()
        peft = _import_peft()
        if not isinstance(shared, peft.PeftModel):
            raise ConfigError(f"AdapterAgent needs a peft.PeftModel; got {type(shared).__name__}. "
                              "Use build_lora_agents(base, peft_config, num_agents).")
        if adapter_name not in shared.peft_config:
            raise ConfigError(f"adapter {adapter_name!r} is not in this PeftModel; it has "
                              f"{sorted(shared.peft_config)}.")
        if shared.peft_config[adapter_name].is_prompt_learning:
            raise ConfigError(f"adapter {adapter_name!r} is prompt learning; AdapterAgent needs an adapter method "
                              "such as LoRA.")
        object.__setattr__(self, "_shared", shared)  # not a submodule: parameters() stay the adapter's
        object.__setattr__(self, "adapter_name", adapter_name)
        named = _adapter_parameters(shared, adapter_name)
        if not named:
            raise ConfigError(f"adapter {adapter_name!r} has no parameters in this PeftModel.")
        for key, param in named:
            self._attach(key, param)
        _group(shared).register(shared, adapter_name, [p for _, p in named])

    def _attach(self, key: str, param: torch.nn.Parameter) -> None:
        """Register ``param`` under the dotted ``key`` through plain container modules."""
        *path, leaf = key.split(".")
        node: torch.nn.Module = self
        for segment in path:
            child = node._modules.get(segment)
            if child is None:
                child = torch.nn.Module()
                node.add_module(segment, child)
            node = child
        if leaf in node._parameters:
            raise ConfigError(f"adapter {self.adapter_name!r}: two parameters map to the key {key!r}.")
        node.register_parameter(leaf, param)

    # --- running ---------------------------------------------------------------------------------

    @property
    def shared(self) -> torch.nn.Module:
        """The ``peft.PeftModel`` every agent of this base runs on."""
        return self._shared

    @property
    def adapter_config(self) -> Any:
        """This adapter's ``PeftConfig`` (as peft holds it, e.g. ``target_modules`` expanded)."""
        return self._shared.peft_config[self.adapter_name]

    def activate(self) -> None:
        """Make this agent's adapter the active one (done by every call; cheap when already active)."""
        _group(self._shared).activate(self._shared, self.adapter_name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.activate()
        return self._shared(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate`` with this agent's adapter."""
        self.activate()
        return self._shared.generate(*args, **kwargs)

    @contextlib.contextmanager
    def reference(self) -> Iterator["AdapterAgent"]:
        """Context in which the shared model runs with every adapter disabled: the frozen base.

        With peft's default LoRA initialisation (B = 0) that is every agent's initial policy, so a KL
        penalty to it needs no copy of the model:

            with torch.no_grad(), agent.reference():
                ref_logp = sequence_log_probs(agent, prompt_ids, prompt_mask, completion_ids)

        Applies to every agent of this base while inside; trainable flags are restored on exit.
        """
        try:
            with self._shared.disable_adapter():
                yield self
        finally:
            _group(self._shared).restore(self._shared)

    # --- what a trainer reads off a model ---------------------------------------------------------

    def get_base_model(self) -> torch.nn.Module:
        """The shared transformers model (adapter layers injected; its own forward runs whichever
        adapter is active, so call the agent instead). Used to inspect the forward signature."""
        return self._shared.get_base_model()

    @property
    def config(self) -> Any:
        return self.get_base_model().config

    @property
    def generation_config(self) -> Any:
        return getattr(self.get_base_model(), "generation_config", None)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._shared.get_input_embeddings()

    def get_output_embeddings(self) -> Optional[torch.nn.Module]:
        return self.get_base_model().get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self._shared.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self._shared.parameters()).dtype

    @property
    def training(self) -> bool:  # type: ignore[override]
        shared = self.__dict__.get("_shared")
        return bool(shared.training) if shared is not None else True

    @training.setter
    def training(self, mode: bool) -> None:
        shared = self.__dict__.get("_shared")  # absent while nn.Module.__init__ sets the flag
        if shared is not None:
            shared.train(mode)

    def train(self, mode: bool = True) -> "AdapterAgent":
        """Set train/eval mode of the shared model (every agent of this base)."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean; got {mode!r}")
        self._shared.train(mode)
        return self

    def _apply(self, fn, recurse: bool = True):  # to(), cuda(), half(), ...: the whole shared model
        self._shared._apply(fn, recurse)
        return self

    def fingerprint(self) -> dict[str, Any]:
        """Identity of what this agent is built on: :func:`base_fingerprint` of the shared base plus a
        digest of this adapter's config. (``comlrl.fingerprint.model_fingerprint(agent)`` covers the
        base config and the adapter's parameter names/shapes/dtypes, not the base's values.)"""
        config = self.adapter_config.to_dict()
        for key in ("base_model_name_or_path", "revision", "inference_mode"):
            config.pop(key, None)
        return {"base": base_fingerprint(self), "adapter_config": digest(_sorted_sets(config))}

    def extra_repr(self) -> str:
        count = sum(p.numel() for p in self.parameters())
        return (f"adapter={self.adapter_name!r}, base={type(self.get_base_model()).__name__}, "
                f"adapter_parameters={count}")

    def __repr__(self) -> str:  # the container tree is bookkeeping; do not print it
        return f"{type(self).__name__}({self.extra_repr()})"

    # --- saving ------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike, merged: bool = False) -> Path:
        """Write this agent to ``directory`` (created if missing; files in it are replaced).

        ``merged=False``: a standard PEFT adapter directory, ``adapter_config.json`` +
        ``adapter_model.safetensors`` at the top (peft itself would put a non-``default`` adapter in a
        subfolder named after it); ``peft.PeftModel.from_pretrained(base, directory)`` loads it.

        ``merged=True``: a plain transformers model directory, the base with this adapter merged in,
        for ``AutoModelForCausalLM.from_pretrained(directory)``. The shared model is not changed:
        each adapted layer is merged in a temporary copy of that one layer, the result moved to the CPU.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if merged:
            self.get_base_model().save_pretrained(directory, state_dict=self._merged_state_dict())
            return directory
        with tempfile.TemporaryDirectory(dir=directory, prefix=".peft-") as tmp:
            self._shared.save_pretrained(tmp, selected_adapters=[self.adapter_name])
            written = Path(tmp) / self.adapter_name if self.adapter_name != "default" else Path(tmp)
            for source in [*written.iterdir(), Path(tmp) / "README.md"]:
                if source.is_file():
                    os.replace(source, directory / source.name)
        return directory

    @torch.no_grad()
    def _merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The base model's state dict (plain key names) with this adapter merged into it."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        base = self.get_base_model()
        modules = dict(base.named_modules())
        wrapped = [k for k, m in modules.items() if isinstance(m, BaseTunerLayer)
                   or hasattr(m, "unload_and_optionally_merge_module")]
        # Outermost wrappers only (a tuner layer's own submodules are handled with it), as peft's unload.
        wrapped = [k for k in wrapped if not any(k.startswith(o + ".") for o in wrapped if o != k)]
        merged: dict[str, torch.Tensor] = {}
        for path in wrapped:
            layer = copy.deepcopy(modules[path])
            if hasattr(layer, "unload_and_optionally_merge_module"):
                plain = layer.unload_and_optionally_merge_module(merge=True, safe_merge=False,
                                                                 adapter_names=[self.adapter_name])
            else:
                layer.merge(adapter_names=[self.adapter_name])  # a layer without this adapter is left as is
                plain = layer.get_base_layer()
            for key, value in plain.state_dict().items():
                merged[f"{path}.{key}"] = value.detach().to("cpu", copy=True)
            del layer, plain
        out = {}
        for key, value in base.state_dict().items():
            if not any(key.startswith(p + ".") for p in wrapped):
                out[key] = value
        out.update(merged)
        return out


def _sorted_sets(value: Any) -> Any:
    """Sets (e.g. peft's expanded target_modules) as sorted lists: string-set order varies by process."""
    if isinstance(value, (set, frozenset)):
        return sorted(_sorted_sets(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _sorted_sets(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sorted_sets(v) for v in value]
    return value
