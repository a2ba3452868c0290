"""Settings every trainer family shares: run length, agents and devices, sampling, turns,
evaluation, buffers, optimisation, reference KL. Family configs subclass :class:`TrainerConfig`
and add or re-default their own fields. Names and defaults follow CoMLRL 1.4.3; the fields after
the CoMLRL block are comlrl's own additions.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

from ..exceptions import ConfigError
from .devices import DeviceScheduler, normalize_parallel_training
from ..tracking.mlflow import check_tracking_uri
from ..tracking.trackers import check_report_to, check_report_to_installed
from .config import (Config, check_bool, check_choice, check_float, check_int, check_str, config_class, optional,
                     setting)

__all__ = ["TrainerConfig", "ROLLOUT_BACKENDS", "MIXED_PRECISIONS", "SHARDINGS", "check_devices"]

ROLLOUT_BACKENDS = ("auto", "hf", "generate", "vllm")
SHARDINGS = ("none", "fsdp2")
MIXED_PRECISIONS = ("bf16",)
Devices = Optional[Union[str, Sequence[str]]]


def check_devices(name: str, value: Any) -> Any:
    """None, one device string, or a list of them (kept as the user wrote it, tuples as lists)."""
    if value is None:
        return None
    if isinstance(value, str):
        DeviceScheduler.resolve_devices(value, 1, kind=name)  # a bad name fails now
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        for v in value:
            if v.strip().lower() != "auto":
                DeviceScheduler.resolve_devices(v, 1, kind=name)
        return list(value)
    raise ConfigError(f"{name} must be None, a device string such as 'cuda:0', or a list of them; got {value!r}.")


def _parallel(name: str, value: Any) -> str:
    return normalize_parallel_training(value)


def _json_dict(name: str, value: Any) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{name} must be a dict with string keys, got {value!r}.")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must hold JSON values (it is saved with every checkpoint): {exc}.") from None
    return value


def _threshold(name: str, value: Any) -> Optional[float]:
    return None if value is None else check_float(lambda v: True, "(finite) or None")(name, value)


_positive = check_float(lambda v: v > 0, "> 0")


@config_class
class TrainerConfig(Config):
    """Settings shared by every trainer. Every invariant is checked when the config is built."""

    DERIVED_DEFAULTS = {"train_batch_size": "rollout_buffer_size"}  # CoMLRL: one optimizer step per buffer

    # --- CoMLRL 1.4.3 fields, with its defaults -----------------------------------------------
    num_train_epochs: int = setting(20, "Epochs in the WHOLE run; resuming with a larger value extends it.",
                                    check_int(1), may_change=True)
    agent_learning_rate: float = setting(5.0e-6, "AdamW learning rate of every agent (constant after warmup).",
                                         _positive)
    logging_steps: int = setting(50, "Log a metrics row once env_step has advanced this many joint actions "
                                     "since the last row (1 = after every optimizer step).",
                                 check_int(1), may_change=True)
    num_agents: int = setting(2, "Agents in the run (the trainer's own count wins when they differ).", check_int(1))
    parallel_training: str = setting("none", "'none': agents run one after another; 'mp': one device per agent "
                                             "(explicit agent_devices), agents sampling at the same time.",
                                     _parallel, may_change=True)
    agent_devices: Devices = setting(None, "None/'auto', one device for all agents, or one per agent.", check_devices,
                                     may_change=True)
    num_generations: int = setting(4, "Completions each agent samples per prompt (the group size K).", check_int(1))
    max_new_tokens: int = setting(256, "Most tokens an agent generates per completion.", check_int(1))
    temperature: float = setting(0.6, "Sampling temperature; the loss scores tokens at the same temperature.",
                                 check_float(lambda v: v > 0, "> 0 (use e.g. 0.01 for near-greedy)"))
    top_p: float = setting(0.6, "Nucleus sampling: keep the smallest token set with this much probability.",
                           check_float(lambda v: 0 < v <= 1, "in (0, 1] (1.0 disables nucleus sampling)"))
    top_k: Optional[int] = setting(50, "Keep only the k most likely tokens; None or 0 = no limit.",
                                   optional(check_int(0)))
    num_turns: int = setting(2, "Turns per episode; > 1 needs the trainer's external_transition.", check_int(1))
    discount: float = setting(1.0, "Gamma of multi-turn returns: G = r + discount * mean(child returns).",
                              check_float(lambda v: 0 <= v <= 1, "in [0, 1]"))
    early_termination_threshold: Optional[float] = setting(
        -0.2, "A node whose mean reward is above this ends its branch (no further turns); None = never.",
        _threshold)
    external_prompt_passthrough: bool = setting(False, "Use the external transition's prompts as they are "
                                                       "instead of passing them through the formatters.", check_bool)
    eval_interval: int = setting(16, "Evaluate before every this-many-th training prompt of an epoch (prompt 0 "
                                     "included); 0 = only when evaluate() is called.", check_int(0), may_change=True)
    eval_num_samples: Optional[int] = setting(4, "Eval prompts per evaluation (the first N); None or 0 = all.",
                                              optional(check_int(0)), may_change=True)
    eval_batch_size: int = setting(1, "Eval prompts sampled together in one batched rollout.", check_int(1),
                                   may_change=True)
    rollout_buffer_size: int = setting(2, "Prompts whose episodes are sampled before the agents are updated on them.",
                                       check_int(1))
    train_batch_size: Optional[int] = setting(None, "Prompts (episode trees) per optimizer step; None = "
                                                    "rollout_buffer_size (one step per buffer).",
                                              optional(check_int(1)))
    advantage_normalization: bool = setting(True, "Divide each group's advantages by its return std (population).",
                                            check_bool)
    reference_kl_enabled: bool = setting(False, "Penalise each agent's returns by its KL to its initial policy.",
                                         check_bool)
    reference_kl_coef: float = setting(0.1, "Weight of the KL penalty subtracted from the return: coef * the "
                                            "completion's log-ratio to the reference (k1; docs/migrating-from-comlrl.md).",
                                       check_float(lambda v: v >= 0, ">= 0"))
    reference_devices: Devices = setting(None, "Devices of the frozen reference models; None = the agents'.",
                                         check_devices, may_change=True)

    # --- comlrl's own settings ----------------------------------------------------------------
    seed: int = setting(42, "Seeds data order, sampling and model code; same seed + same inputs = same run.",
                        check_int(0))
    output_dir: str = setting("outputs", "Where metrics.jsonl goes when train() gets no checkpoint_dir.", check_str,
                              may_change=True)
    report_to: Optional[Union[str, list]] = setting(
        None, "Where metric rows go: 'jsonl' (metrics.jsonl), 'wandb', 'tensorboard', 'mlflow', a list of them, 'all' "
              "(jsonl, wandb and each installed tracker) or 'none'; None = jsonl, plus W&B when wandb_config is given.",
        check_report_to, may_change=True)
    tensorboard_dir: Optional[str] = setting(None, "TensorBoard root (one run-<id> folder per run); None = "
                                                   "<checkpoint_dir or output_dir>/tensorboard.",
                                             optional(check_str), may_change=True)
    mlflow_tracking_uri: Optional[str] = setting(None, "MLflow tracking server or store; None = MLFLOW_TRACKING_URI, "
                                                       "else MLflow's default. No credentials in it (use MLflow's "
                                                       "environment variables).", check_tracking_uri, may_change=True)
    mlflow_experiment_name: Optional[str] = setting(None, "MLflow experiment of a new run; None = "
                                                          "MLFLOW_EXPERIMENT_NAME, else 'comlrl'.",
                                                    optional(check_str), may_change=True)
    mlflow_run_name: Optional[str] = setting(None, "Name of a new MLflow run; None = MLflow picks one.",
                                             optional(check_str), may_change=True)
    tracker_failure: str = setting(
        "raise", "A tracker of report_to that fails while logging (a 503, a full disk): 'raise' (train() stops with "
                 "TrackerError once the checkpoint due at that point is written) or 'disable' (a warning; training "
                 "goes on without that tracker until train() returns).",
        check_choice("raise", "disable", aliases={"warn": "disable", "ignore": "disable"}), may_change=True)
    shuffle: bool = setting(False, "Reshuffle the prompts every epoch (order derived from seed and epoch).",
                            check_bool)
    warmup_steps: int = setting(0, "Linear learning-rate warmup over this many optimizer steps.", check_int(0))
    weight_decay: float = setting(0.01, "AdamW decoupled weight decay (torch's default, as in CoMLRL 1.4.3).",
                                  check_float(lambda v: v >= 0, ">= 0"))
    adam_beta1: float = setting(0.9, "AdamW beta1.", check_float(lambda v: 0 <= v < 1, "in [0, 1)"))
    adam_beta2: float = setting(0.999, "AdamW beta2.", check_float(lambda v: 0 <= v < 1, "in [0, 1)"))
    adam_epsilon: float = setting(1e-8, "AdamW epsilon.", _positive)
    max_grad_norm: Optional[float] = setting(None, "Clip each agent's gradient to this L2 norm; None = no clipping.",
                                             optional(_positive))
    micro_batch_size: Optional[int] = setting(None, "Groups (one agent's K completions of one node) per forward/"
                                                    "backward pass of the update; None = all at once. Memory "
                                                    "only: the gradient is the same.", optional(check_int(1)))
    nonfinite: str = setting("raise", "A non-finite loss or gradient: 'raise' (stop before the optimizer step) or "
                                      "'skip' (drop the update whose gradient is not finite: one agent's, counted in "
                                      "agent_i/skipped_steps; train/skipped_steps counts steps that updated nothing).",
                             check_choice("raise", "skip"))
    mixed_precision: Optional[str] = setting(None, "'bf16': weights and AdamW stay float32 (the masters); sampling "
                                                   "runs on bfloat16 copies refreshed after each optimizer step, the "
                                                   "frozen reference is kept in bfloat16, the update's forwards and "
                                                   "backwards run on the same copies, their gradients summed into "
                                                   "the float32 masters (LoRA agents, model.generate samplers, the "
                                                   "vLLM backend, IAC's and MADPO's losses: under "
                                                   "torch.autocast(bfloat16)); sharded agents use FSDP2's "
                                                   "MixedPrecisionPolicy(param_dtype=bfloat16). None = the model's "
                                                   "dtype.",
                                             optional(check_choice(*MIXED_PRECISIONS)))
    rollout_backend: str = setting("auto", "'auto': the lean decoder for Qwen2/Llama/Mistral, model.generate for "
                                           "models with a custom generate(), else our transformers loop; 'hf': "
                                           "our transformers loop; 'generate': model.generate; 'vllm': one vLLM "
                                           "engine per agent.", check_choice(*ROLLOUT_BACKENDS))
    vllm_gpu_memory_utilization: Optional[float] = setting(
        None, "rollout_backend='vllm': fraction of its GPU each engine may take; None = 0.3 shared per device.",
        optional(check_float(lambda v: 0 < v <= 1, "in (0, 1]")), may_change=True)
    vllm_engine_kwargs: Optional[dict] = setting(None, "rollout_backend='vllm': more vllm.LLM keyword arguments.",
                                                 _json_dict, may_change=True)
    sharding: str = setting("none", "'none': every process holds every agent whole; 'fsdp2': each agent's parameters, "
                                    "gradients and AdamW state are sharded over the processes torchrun starts "
                                    "(torch's fully_shard, per decoder layer; docs/scaling.md).",
                            check_choice(*SHARDINGS), may_change=True)
    sharding_group_size: Optional[int] = setting(None, "sharding='fsdp2': shard within groups of this many processes "
                                                       "(e.g. the GPUs of one node) and replicate across groups "
                                                       "(HSDP); None = shard over every process.",
                                                 optional(check_int(1)), may_change=True)

    def validate(self) -> None:
        super().validate()
        self._check_generations()
        if self.parallel_training == "mp" and self.agent_devices is None:
            raise ConfigError("parallel_training='mp' needs explicit agent_devices (one device per agent, e.g. "
                              "['cuda:0', 'cuda:1']); set agent_devices or use parallel_training='none'.")
        # agent_devices' length is checked against the trainer's agent count when it places them.
        if self.reference_kl_enabled and self.reference_devices is not None:
            DeviceScheduler.resolve_devices(self.reference_devices, self._actor_count(), kind="reference_devices")
        self._check_trackers()
        if self.rollout_backend == "vllm":
            from ..rollout.vllm import check_vllm_available

            check_vllm_available(self.temperature)
        elif self.vllm_gpu_memory_utilization is not None or self.vllm_engine_kwargs is not None:
            raise ConfigError(f"vllm_gpu_memory_utilization / vllm_engine_kwargs only apply to rollout_backend='vllm' "
                              f"(got rollout_backend={self.rollout_backend!r}); remove them or set "
                              "rollout_backend='vllm'.")
        if self.sharding == "fsdp2" and self.rollout_backend in ("vllm", "generate"):
            raise ConfigError(f"sharding='fsdp2' samples with comlrl's transformers loop over the gathered agents; "
                              f"rollout_backend={self.rollout_backend!r} does not run on sharded agents. Use "
                              "rollout_backend='auto' or 'hf'.")
        if self.sharding_group_size is not None and self.sharding != "fsdp2":
            raise ConfigError("sharding_group_size applies to sharding='fsdp2'; set sharding='fsdp2' or remove it.")

    def _check_trackers(self) -> None:
        check_report_to_installed(self.report_to)
        for tracker, fields in (("tensorboard", ("tensorboard_dir",)),
                                ("mlflow", ("mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name"))):
            given = [f for f in fields if getattr(self, f) is not None]
            if given and tracker not in (self.report_to or ()):
                raise ConfigError(f"{' / '.join(given)}: used only when report_to includes {tracker!r} (report_to="
                                  f"{self.report_to!r}); add {tracker!r} to report_to or remove "
                                  f"{'it' if len(given) == 1 else 'them'}.")

    def _check_generations(self) -> None:
        """Group baselines compare a completion with its siblings: K >= 2 (actor-critic overrides)."""
        if self.num_generations < 2:
            raise ConfigError(f"num_generations must be >= 2 (the group baseline compares a completion with the "
                              f"others sampled for the same prompt), got {self.num_generations}.")

    def _actor_count(self) -> int:
        """How many policy models the run trains (one per agent; a centralised run has one)."""
        return self.num_agents
