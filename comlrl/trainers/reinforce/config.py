"""MAGRPOConfig: every setting of a MAGRPO run, checked when it is built."""

from __future__ import annotations

import dataclasses
import json
import difflib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...exceptions import ConfigError

__all__ = ["MAGRPOConfig", "MAREINFORCEConfig", "MARLOOConfig", "MAReMaxConfig", "RESUMABLE_FIELDS"]

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
JOINT_MODES = ("aligned", "cross")
LOSS_TYPES = ("grpo", "token_mean", "dr_grpo")
ROLLOUT_BACKENDS = ("auto", "hf", "vllm")
MIXED_PRECISIONS = ("bf16",)

# Names users of other libraries type, mapped to ours, for the "unknown field" message.
_ALIASES = {
    "learning_rate": "agent_learning_rate",
    "lr": "agent_learning_rate",
    "per_device_train_batch_size": "train_batch_size",
    "batch_size": "train_batch_size",
    "num_epochs": "num_train_epochs",
    "epochs": "num_train_epochs",
    "grad_clip": "max_grad_norm",
    "max_completion_length": "max_new_tokens",
    "scale_rewards": "advantage_normalization",
    "group_size": "num_generations",
    "beta": "reference_kl_coef",
    "bf16": "mixed_precision",
    "fp16": "mixed_precision",
    "kl_coef": "reference_kl_coef",
}


def _may_change(default: Any, doc: str) -> Any:
    """A field that may differ between a checkpoint and the run that resumes it."""
    return field(default=default, metadata={"doc": doc, "may_change_on_resume": True})


def _fixed(default: Any, doc: str) -> Any:
    """A field that must be equal on resume (the checkpoint's fingerprint covers it)."""
    return field(default=default, metadata={"doc": doc, "may_change_on_resume": False})


@dataclass(frozen=True)
class MAGRPOConfig:
    """Settings of a MAGRPO run. Frozen: build a new one (``dataclasses.replace``) to change it.

    Every invariant is checked in ``__post_init__``; a bad value raises
    :class:`comlrl.exceptions.ConfigError` naming the field and what to change.
    """

    # --- length of the run and bookkeeping -------------------------------------------------------
    num_train_epochs: int = _may_change(20, "Epochs in the WHOLE run; resuming with a larger value extends it.")
    logging_steps: int = _may_change(10, "Log metrics every this many optimizer steps (averaged over them).")
    output_dir: str = _may_change("outputs", "Where metrics.jsonl goes when train() gets no checkpoint_dir.")
    device: Optional[str] = _may_change(None, "Device for all agents, e.g. 'cpu', 'cuda:0'; None = cuda if available.")
    agent_devices: Optional[tuple[str, ...]] = _may_change(None, "One device per agent, e.g. ('cuda:0', 'cuda:1'), instead of device.")
    eval_interval: int = _may_change(0, "Evaluate on eval_dataset every this many optimizer steps; 0 = only when called.")
    eval_num_samples: Optional[int] = _may_change(None, "Eval prompts used per evaluation (the first N); None = all.")
    seed: int = _fixed(42, "Seeds data order, sampling and model code; same seed + same inputs = same run.")

    # --- optimisation (one AdamW per agent) ------------------------------------------------------
    agent_learning_rate: float = _fixed(5.0e-6, "AdamW learning rate of every agent (constant after warmup).")
    warmup_steps: int = _fixed(0, "Linear warmup of the learning rate over this many optimizer steps.")
    weight_decay: float = _fixed(0.0, "AdamW decoupled weight decay.")
    adam_beta1: float = _fixed(0.9, "AdamW beta1.")
    adam_beta2: float = _fixed(0.999, "AdamW beta2.")
    adam_epsilon: float = _fixed(1e-8, "AdamW epsilon.")
    max_grad_norm: Optional[float] = _fixed(1.0, "Clip each agent's gradient to this L2 norm; None = no clipping.")
    train_batch_size: int = _fixed(1, "Prompts per micro-batch; rollout and loss are batched over prompts x generations.")
    gradient_accumulation_steps: int = _fixed(1, "Micro-batches per optimizer step.")
    shuffle: bool = _fixed(True, "Shuffle the prompts every epoch (order derived from seed and epoch).")

    # --- sampling ----------------------------------------------------------------------------------
    num_generations: int = _fixed(4, "Completions each agent samples per prompt (the group size K).")
    max_new_tokens: int = _fixed(256, "Most tokens an agent generates per completion.")
    temperature: float = _fixed(1.0, "Sampling temperature; the loss scores tokens at the same temperature.")
    top_p: float = _fixed(1.0, "Nucleus sampling: keep the smallest token set with this much probability.")
    mixed_precision: Optional[str] = _fixed(None, "'bf16': run rollout and loss forwards under torch.autocast(bfloat16) (weights and AdamW stay in their dtype); None = the model's dtype.")
    rollout_backend: str = _fixed("auto", "'auto': one-token steps on comlrl's lean decoder for Qwen2/Llama/Mistral (checked against transformers once per model), else transformers; 'hf': always the transformers forward; 'vllm': one colocated vLLM engine per agent (pip install 'comlrl[vllm]'; CUDA, full-model agents, one process).")
    vllm_gpu_memory_utilization: Optional[float] = _may_change(None, "rollout_backend='vllm': fraction of its GPU each agent's engine may take; None = 0.3 shared by the engines on a device.")
    vllm_engine_kwargs: Optional[dict] = _may_change(None, "rollout_backend='vllm': more vllm.LLM keyword arguments (JSON values), e.g. {'max_model_len': 4096}.")
    top_k: Optional[int] = _fixed(50, "Keep only the k most likely tokens (transformers' default 50); None or 0 = no limit.")

    # --- MAGRPO ------------------------------------------------------------------------------------
    num_turns: int = _fixed(1, "Turns per episode; > 1 needs the trainer's external_transition.")
    discount: float = _fixed(0.9, "Gamma for multi-turn returns: G = r + discount * mean(child returns); 1.0 = undiscounted.")
    termination_threshold: Optional[float] = _fixed(None, "A branch ends early once its joint reward reaches this value (higher is better); None = never.")
    joint_mode: str = _fixed("aligned", "'aligned': completion i of every agent forms joint action i (K per prompt); "
                                        "'cross': every combination (K**num_agents per prompt).")
    max_joint_actions: int = _fixed(4096, "Refuse settings scoring more joint actions per prompt, all turns together (K**N per node in cross mode, J**t nodes at turn t).")
    advantage_mode: str = _fixed("mean", "Baseline: 'mean' (r - group mean), 'raw' (r), 'max' (r - group max), 'rloo'.")
    advantage_normalization: bool = _fixed(False, "Divide advantages by the group's reward std (GRPO's scaling).")
    reference_kl_coef: float = _fixed(0.0, "Weight of a KL penalty to each agent's initial policy, on the tokens the loss scores (k3 estimator); 0 = off.")
    loss_type: str = _fixed("grpo", "'grpo': mean over a completion's tokens, then over completions; "
                                    "'token_mean': mean over all tokens; 'dr_grpo': sum / max_new_tokens.")

    def __post_init__(self) -> None:
        _check_int(self, "num_train_epochs", minimum=1)
        _check_int(self, "logging_steps", minimum=1)
        _check_int(self, "seed", minimum=0)
        _check_int(self, "eval_interval", minimum=0)
        if self.eval_num_samples is not None:
            _check_int(self, "eval_num_samples", minimum=1)
        _check_int(self, "warmup_steps", minimum=0)
        _check_int(self, "train_batch_size", minimum=1)
        _check_int(self, "gradient_accumulation_steps", minimum=1)
        _check_int(self, "num_turns", minimum=1)
        _check_int(self, "max_joint_actions", minimum=1)
        _check_int(self, "max_new_tokens", minimum=1)
        if not isinstance(self.num_generations, int) or isinstance(self.num_generations, bool) \
                or self.num_generations < 2:
            raise ConfigError(
                f"num_generations must be an int >= 2 (the group baseline compares a completion with the "
                f"others sampled for the same prompt), got {self.num_generations!r}. Set num_generations=2 or more."
            )
        _check_float(self, "agent_learning_rate", lambda v: v > 0, "> 0")
        _check_float(self, "weight_decay", lambda v: v >= 0, ">= 0")
        _check_float(self, "adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)")
        _check_float(self, "adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        _check_float(self, "adam_epsilon", lambda v: v > 0, "> 0")
        _check_float(self, "temperature", lambda v: v > 0, "> 0 (use a small value such as 0.01 for near-greedy)")
        _check_float(self, "top_p", lambda v: 0 < v <= 1, "in (0, 1] (1.0 disables nucleus sampling)")
        if self.max_grad_norm is not None:
            _check_float(self, "max_grad_norm", lambda v: v > 0, "> 0, or None to disable clipping")
        if self.top_k is not None:
            _check_int(self, "top_k", minimum=0)
        if not isinstance(self.shuffle, bool):
            raise ConfigError(f"shuffle must be True or False, got {self.shuffle!r}.")
        if not isinstance(self.advantage_normalization, bool):
            raise ConfigError(f"advantage_normalization must be True or False, got {self.advantage_normalization!r}.")
        _check_choice(self, "joint_mode", JOINT_MODES)
        _check_choice(self, "advantage_mode", ADVANTAGE_MODES)
        _check_choice(self, "loss_type", LOSS_TYPES)
        _check_choice(self, "rollout_backend", ROLLOUT_BACKENDS)
        if self.vllm_gpu_memory_utilization is not None:
            _check_float(self, "vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]")
        if self.vllm_engine_kwargs is not None:
            if not isinstance(self.vllm_engine_kwargs, dict) or not all(isinstance(k, str) for k in self.vllm_engine_kwargs):
                raise ConfigError(f"vllm_engine_kwargs must be a dict of vllm.LLM keyword arguments, got "
                                  f"{self.vllm_engine_kwargs!r}.")
            try:
                json.dumps(self.vllm_engine_kwargs)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"vllm_engine_kwargs must hold JSON values (it is saved with every checkpoint): {exc}. "
                                  "Pass plain numbers, strings, lists and dicts.") from exc
        if self.rollout_backend == "vllm":
            from ...vllm_backend import check_vllm_available
            check_vllm_available(self.temperature)
        elif self.vllm_gpu_memory_utilization is not None or self.vllm_engine_kwargs is not None:
            raise ConfigError(f"vllm_gpu_memory_utilization / vllm_engine_kwargs only apply to rollout_backend='vllm' "
                              f"(got rollout_backend={self.rollout_backend!r}); remove them or set rollout_backend='vllm'.")
        if self.mixed_precision is not None:
            _check_choice(self, "mixed_precision", MIXED_PRECISIONS)
        _check_float(self, "discount", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_float(self, "reference_kl_coef", lambda v: v >= 0, ">= 0 (0 disables the KL penalty)")
        if self.termination_threshold is not None:
            _check_float(self, "termination_threshold", lambda v: True, "(finite)")
        for name in ("device",) + (("agent_devices",) if self.agent_devices is not None else ()):
            values = [self.device] if name == "device" else self.agent_devices
            if name == "agent_devices":
                if isinstance(values, str) or not isinstance(values, (list, tuple)) or not values:
                    raise ConfigError(f"agent_devices must be a list of device strings, one per agent, e.g. "
                                      f"['cuda:0', 'cuda:1']; got {values!r}.")
                object.__setattr__(self, "agent_devices", tuple(values))  # frozen: normalise once, here
            for value in values:
                if value is None and name == "device":
                    continue
                try:
                    torch.device(value)
                except (RuntimeError, TypeError) as exc:
                    raise ConfigError(f"{name}: {value!r} is not a device such as 'cpu' or 'cuda:0' ({exc}).") from exc
        if self.device is not None and self.agent_devices is not None:
            raise ConfigError("set either device (all agents) or agent_devices (one per agent), not both.")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ConfigError(f"output_dir must be a non-empty path string, got {self.output_dir!r}.")

    # ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MAGRPOConfig":
        """Build from a dict (e.g. a checkpoint's saved config); unknown keys raise ConfigError."""
        return cls(**values)


RESUMABLE_FIELDS = frozenset(
    f.name for f in dataclasses.fields(MAGRPOConfig) if f.metadata.get("may_change_on_resume")
)


def _check_int(cfg: MAGRPOConfig, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}. Change {name}.")


def _check_float(cfg: MAGRPOConfig, name: str, ok, what: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{name} must be a number {what}, got {value!r}. Change {name}.")


def _check_choice(cfg: MAGRPOConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")


def _reject_unknown_fields(cls):
    """Wrap a config's dataclass __init__ so a misspelt field names the closest real one."""
    names = [f.name for f in dataclasses.fields(cls)]
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for key in unknown:
                guess = _ALIASES.get(key) or next(iter(difflib.get_close_matches(key, names, n=1)), None)
                hints.append(f"{key!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
            raise ConfigError(f"{cls.__name__} has no field {', '.join(hints)}. Known fields: {', '.join(names)}.")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_reject_unknown_fields(MAGRPOConfig)


# Named variants: MAGRPO with another baseline (see comlrl.advantages.group_advantages).
@_reject_unknown_fields
@dataclass(frozen=True)
class MAREINFORCEConfig(MAGRPOConfig):
    """MAGRPO without a baseline: the advantage is the raw return (multi-agent REINFORCE)."""

    advantage_mode: str = _fixed("raw", "Baseline: 'raw' (no baseline) for MAREINFORCE.")


@_reject_unknown_fields
@dataclass(frozen=True)
class MARLOOConfig(MAGRPOConfig):
    """MAGRPO with the leave-one-out baseline: the mean return of the group's other samples."""

    advantage_mode: str = _fixed("rloo", "Baseline: 'rloo' (mean of the other samples) for MARLOO.")


@_reject_unknown_fields
@dataclass(frozen=True)
class MAReMaxConfig(MAGRPOConfig):
    """MAGRPO with the group's best return as baseline (ReMax-style)."""

    advantage_mode: str = _fixed("max", "Baseline: 'max' (the group's best return) for MAReMax.")
