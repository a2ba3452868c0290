"""The engine every trainer family runs on: inputs, the epoch loop, evaluation, checkpoints.

A family subclasses :class:`Trainer` and supplies its algorithm: :meth:`Trainer.collect` and
:meth:`Trainer.optimizer_step` (the phases of its optimizer steps on one buffer of prompts, run
by :meth:`Trainer.train_buffer`) and, when it trains more than the agents,
:meth:`Trainer.trained_slots`. Everything else (data order, evaluation cadence, logging at
``env_step``, checkpoint triggers, resume, locking, trackers) is here, once. The run loop
(engine/loop.py) calls the trainer only through the public methods of
:class:`comlrl.engine.schedule.LoopTrainer`, all implemented here; a multi-phase family (MADPO,
MARLHF) overrides the schedule ones.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..checkpoint.manager import CheckpointManager, Slots
from ..exceptions import ConfigError, TrainingError
from ..functional.logprobs import sequence_log_probs
from ..rollout import Rollout, SamplingParams, make_backend
from ..tracking import Tracker, TrackerContext, active_trackers, check_wandb_config, open_trackers
from ..tracking.wandb import verbose_from_wandb_config
from . import distributed as dist
from .collect import Collector, PromptBatch, train_seeds
from .episode import ExternalTransition
from .evaluation import Evaluation
from .host_memory import tune_malloc
from .inputs import (agent_count, check_context, check_tokenizers_usable, distinct_modules, frozen_copies,
                     resolve_agents, wants_cuda)
from .loop import RunLoop, check_train_args
from .metrics import episode_metrics, merge_records
from .persistence import Persistence
from .prompts import PromptTable, build_formatter_list
from .rewards import RewardFunction
from .schedule import TrainingLoop
from .settings import TrainerConfig
from .state import PlayedBuffer, TrainState
from .step import allocate_adam_state, apply_gradients, own_parameters
from .streams import Stream, stream_rng
from .timing import PhaseTimer

AutocastFactory = Callable[[], contextlib.AbstractContextManager]

__all__ = ["Trainer"]

logger = logging.getLogger("comlrl")


_WARNED: set[str] = set()  # deprecations said once per process


def legacy_dataset_type(value: Any) -> Optional[str]:
    """The ``dataset_type=`` argument of CoMLRL 1.3.9-1.4.2 trainers (1.4.3 refuses it): accepted,
    recorded in the tracker run config as ``dataset_type``, and deprecated (said once per process).
    It changes nothing in training; ``wandb_config["config_sections"]["dataset"]["type"]`` records
    the same."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"dataset_type must be a string (e.g. 'humaneval'), got {type(value).__name__}; it is "
                          "deprecated: put the type in wandb_config['config_sections']['dataset']['type'] instead.")
    if "dataset_type" not in _WARNED:
        _WARNED.add("dataset_type")
        warnings.warn("dataset_type= is deprecated (CoMLRL 1.3.9-1.4.2 took it; 1.4.3 refuses it): comlrl "
                      "accepts it, records it in the run config as dataset_type and otherwise ignores it. Drop the "
                      "argument and put the type in wandb_config['config_sections']['dataset']['type'].", FutureWarning,
                      stacklevel=_caller_stacklevel())
    return value


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside comlrl (the user's trainer construction)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        level, frame = level + 1, frame.f_back
    return level


class Trainer(Evaluation, Persistence):
    """Base of every trainer (see the module docstring and docs/extending.md); a family sets
    ``config_class`` and ``algorithm_name`` and implements :meth:`collect` and
    :meth:`optimizer_step`. The keyword arguments are those of :class:`MAGRPOTrainer`."""

    config_class: type[TrainerConfig] = TrainerConfig
    algorithm_name = "Trainer"

    def __init__(self, *, args: Optional[TrainerConfig] = None, agent_model: Any = None,
                 agents: Optional[Sequence[Any]] = None, num_agents: Optional[int] = None, tokenizer: Any = None,
                 model_config: Optional[Mapping[str, Any]] = None, train_dataset: Any = None, eval_dataset: Any = None,
                 reward_func: Any = None, reward_processor: Any = None, formatters: Any = None,
                 external_transition: Any = None, wandb_config: Optional[Mapping[str, Any]] = None,
                 eval_logger: Any = None, eval_aggregator: Any = None, peft_config: Any = None,
                 dataset_type: Optional[str] = None):
        self.args = self._check_args(args)
        self.wandb_config = check_wandb_config(wandb_config)
        self.dataset_type = legacy_dataset_type(dataset_type)
        self._check_output_dir()
        if not callable(reward_func):
            raise ConfigError("reward_func must be a callable: f(completions1, ..., completionsN) -> list of floats.")
        count = agent_count(agent_model, agents, num_agents, self.args.num_agents)
        if self.args.num_turns > 1 and external_transition is None:
            raise ConfigError(f"num_turns={self.args.num_turns} needs an external_transition(prompt=..., "
                              "agent_completions=..., num_agents=...) returning the agents' next prompts; pass one "
                              "or set num_turns=1.")
        self._early_checks(count)
        self._check_sharding(peft_config)
        self.model_config = dict(model_config or {})
        self.dist = dist.init_distributed(use_cuda=wants_cuda(self.args.agent_devices, count),
                                          always=self.args.sharding == "fsdp2")
        devices = self.args.agent_devices
        if self.dist.enabled and devices in (None, "auto") and torch.cuda.is_available():
            devices = "cuda"  # under torchrun, automatic placement is this process's GPU (cuda:LOCAL_RANK)
        resolved = resolve_agents(agent_model, agents, count, tokenizer, self.model_config, devices, peft_config,
                                  self.args.seed)
        self._resolved = resolved
        self.tokenizers = list(resolved.tokenizers)
        self.tokenizer = self.tokenizers[0]
        self.num_agents, self.model_name = len(resolved.models), resolved.model_name
        self.agent_devices, self.device = list(resolved.devices), resolved.devices[0]
        if any(d.type == "cpu" for d in self.agent_devices):
            tune_malloc()  # the step's large tensors reused, not faulted in again (engine/host_memory.py)
        self.agents = self._trained_models(resolved)
        self._warn_count(count)
        self.reward_func, self.reward_processor = reward_func, reward_processor
        self.reward = RewardFunction(reward_func, self._reward_arity(), reward_processor,
                                     per_agent=self._per_agent_rewards(), agent_prompts=self._per_agent_rewards())
        self.formatters = build_formatter_list(formatters, self._prompted_count())
        self.external_transition = external_transition
        self.transition = ExternalTransition(external_transition, self.num_agents) \
            if external_transition is not None and self.args.num_turns > 1 else None
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.eval_logger, self.eval_aggregator = eval_logger, eval_aggregator
        self._eval_callbacks()  # a logger that cannot take CoMLRL's arguments is refused now
        self._tables: dict[str, tuple[int, PromptTable]] = {}
        if train_dataset is not None:
            self._table("train")  # a formatter or prompt problem stops the run before it starts
        if eval_dataset is not None:
            self._table("eval")
        dist.broadcast_parameters(self._broadcast_modules(), self.dist)
        self.reference_models = self._references()
        if self.sharded:
            self._shard()
        self._set_seed()
        self.optimizers, self.schedulers = self._optimizers(self.agents)
        backend = "hf" if self.sharded and self.args.rollout_backend == "auto" else self.args.rollout_backend
        self.backend = make_backend(backend, self._policies(), self.tokenizers, seed=self.args.seed,
                                    world_size=self.dist.world_size, vllm_options=self._vllm_options(),
                                    compute_dtype=self.compute_dtype)
        self.state = TrainState()
        self.run_id = dist.gather_objects(uuid.uuid4().hex, self.dist)[0]  # rank 0's, on every rank
        self.checkpoints = CheckpointManager(is_main=self.dist.is_main)
        self.wandb_identity: Optional[dict[str, str]] = None
        self.tracker_identities: dict[str, dict[str, str]] = {}  # other trackers' ("mlflow"), saved with W&B's
        self.tracker_notes: dict[str, str] = {}  # how each tracker of the last train() logged (W&B: "offline")
        self.verbose = verbose_from_wandb_config(wandb_config)
        self._fingerprint_cache: Optional[dict[str, Any]] = None
        self._code_fingerprints()  # before any reward call (see its docstring)
        self._buffer: Optional[PlayedBuffer] = None
        self._closed = False

    # ------------------------------------------------------------------------------------------
    # construction helpers (families override the small ones)
    # ------------------------------------------------------------------------------------------
    def _check_args(self, args: Optional[TrainerConfig]) -> TrainerConfig:
        if args is None:
            args = self.config_class()
        if not isinstance(args, self._accepted_config()):
            raise ConfigError(f"args must be a {self._accepted_config().__name__}, got {type(args).__name__}.")
        args.validate()
        return args

    def _check_output_dir(self) -> None:
        given = (self.wandb_config or {}).get("output_dir")
        default = type(self.args).__dataclass_fields__["output_dir"].default
        if given is not None and self.args.output_dir not in (default, str(given)):
            raise ConfigError(f"wandb_config['output_dir']={str(given)!r} and args.output_dir={self.args.output_dir!r} "
                              "both say where the run's outputs go; give one (args.output_dir is comlrl's, "
                              "wandb_config['output_dir'] CoMLRL 1.4.3's).")

    @property
    def outputs_dir(self) -> Path:
        """Where a run's files go when ``train()`` gets no ``checkpoint_dir`` (``metrics.jsonl``):
        ``wandb_config["output_dir"]`` when given (CoMLRL 1.4.3's key), else ``args.output_dir``."""
        return self.legacy_outputs_dir() or Path(self.args.output_dir)

    def legacy_outputs_dir(self) -> Optional[Path]:
        """``wandb_config["output_dir"]`` (CoMLRL 1.4.3: the root of the preference family's output
        folders, whatever the checkpoint_dir), or None."""
        given = (self.wandb_config or {}).get("output_dir")
        return Path(given) if given is not None else None

    def _accepted_config(self) -> type:
        return self.config_class

    #: Whether the family runs with ``sharding="fsdp2"`` (its update equalises the passes of every
    #: process and its trained modules are plain transformers models; see engine/sharding.py).
    supports_sharding = False

    @property
    def sharded(self) -> bool:
        """Whether the agents are sharded with FSDP2 (``sharding="fsdp2"``)."""
        return self.args.sharding == "fsdp2"

    def _check_sharding(self, peft_config: Any) -> None:
        """``sharding="fsdp2"``: refused, before any model loads, where it cannot run."""
        if not self.sharded:
            return
        if not self.supports_sharding:
            raise ConfigError(f"{type(self).__name__} does not run with sharding='fsdp2' (only the REINFORCE family "
                              "does: MAGRPO, its variants, MAHAGRPO). Use sharding='none' with data parallelism, "
                              "agents on separate devices (agent_devices), or LoRA agents (docs/scaling.md).")
        if peft_config is not None:
            raise ConfigError("sharding='fsdp2' shards full agents; LoRA agents (peft_config) keep one frozen base and "
                              "small adapters, which need no sharding. Use one or the other.")
        if "WORLD_SIZE" not in os.environ:
            raise ConfigError("sharding='fsdp2' runs under torchrun, which starts the processes the agents are sharded "
                              "over: torchrun --nproc_per_node N your_script.py (N=1 works too).")

    def _shard(self) -> None:
        """Shard every agent (and reference model) over the processes (engine/sharding.py); each
        checkpoint folder's layout and side files are taken first, from the whole model."""
        from .sharding import device_mesh, shard_model

        self.fingerprint_extra()  # what it reads of the whole models (a frozen reference's values), taken now
        for slot, module in self.trained_slots_before_optimizers().items():
            layout = self._layout(slot, module)
            if layout.parts != (("", "model.safetensors"),):
                raise ConfigError(f"sharding='fsdp2' shards plain transformers models; {slot} is a "
                                  f"{type(module).__name__}, whose checkpoint folder has several parts.")
        device = self.agent_devices[0].type
        mesh = device_mesh(self.dist, device, self.args.sharding_group_size)
        for model in distinct_modules(list(self.agents) + [r for r in self.reference_models if r is not None]):
            shard_model(model, mesh, torch.bfloat16 if self.args.mixed_precision == "bf16" else None)

    def trained_slots_before_optimizers(self) -> dict[str, torch.nn.Module]:
        """The trained modules by slot, before the optimizers exist (see :meth:`trained_slots`)."""
        return {f"agent-{i}": m for i, m in enumerate(self.agents)}

    def _sampling(self) -> contextlib.AbstractContextManager:
        """Around sampling: sharded agents gathered whole (engine/sharding.py), else nothing."""
        if not self.sharded:
            return contextlib.nullcontext()
        from .sharding import gathered

        return gathered(self._policies())

    def _early_checks(self, count: int) -> None:
        """Checks of the arguments that must fail before any model is loaded (families extend)."""

    def _trained_models(self, resolved: Any) -> list[torch.nn.Module]:
        """The trained modules of the agents, from the resolved policies (a family may wrap them)."""
        return list(resolved.models)

    def _policies(self) -> list[torch.nn.Module]:
        """The language models that sample, one per agent (what the rollout backend runs)."""
        return self.agents

    def _policies_of(self, modules: Sequence[torch.nn.Module]) -> list[int]:
        """The agents whose policy shares a parameter with ``modules`` (what an optimizer step of
        them changes: a copy of only those goes stale; a critic changes none)."""
        stepped = {id(p) for m in modules for p in m.parameters()}
        return [a for a, policy in enumerate(self._policies()) if any(id(p) in stepped for p in policy.parameters())]

    # --- the schedule: what the run loop calls (engine/schedule.py's LoopTrainer) --------------------
    def is_complete(self) -> bool:
        """Whether every epoch of the run is done (train() then has nothing to do)."""
        return self.state.epoch >= self.args.num_train_epochs

    def run_schedule(self, loop: TrainingLoop, progress: Any) -> None:
        """The run's work between opening and closing its trackers and checkpoint directory: the
        epochs of buffers (a multi-phase family runs its phases around them)."""
        while self.state.epoch < self.args.num_train_epochs:
            loop.run_epoch(progress)

    def total_steps(self) -> Optional[int]:
        """Optimizer steps of the whole run, for the progress bar (None: not known up front)."""
        size, batch = len(self.epoch_order(0)), self.buffer_prompts()
        per_epoch = sum(math.ceil(min(batch, size - s) / self._step_prompts()) for s in range(0, size, batch))
        return self.args.num_train_epochs * per_epoch * self.update_passes()

    def epoch_position(self, epoch: float) -> float:
        """The ``epoch`` value of a logged row (a family with phases may offset it)."""
        return epoch

    def eval_due(self, start: int, count: int) -> bool:
        """Whether to evaluate before the buffer of prompts ``start .. start + count`` of an epoch:
        CoMLRL's cadence, before every prompt i with ``i % eval_interval == 0``."""
        every = self.args.eval_interval
        return bool(every) and -(-start // every) * every < start + count

    def buffer_prompts(self) -> int:
        """Prompts per buffer: their episodes are played before the updates on them."""
        return self.args.rollout_buffer_size

    def _step_prompts(self) -> int:
        """Prompts per optimizer step."""
        return self.args.train_batch_size

    def update_passes(self) -> int:
        """How many times the optimizer steps go over one buffer's episodes (PPO's epochs)."""
        return 1

    def _warn_count(self, count: int) -> None:
        if self.args.num_agents != count:
            logger.warning("comlrl: the config says num_agents=%d but the trainer has %d agents; training %d.",
                           self.args.num_agents, count, count)

    def _reward_arity(self) -> int:
        """How many completion lists the reward function takes (one per agent)."""
        return self.num_agents

    def _per_agent_rewards(self) -> bool:
        """Whether the reward may give each agent its own reward (families with per-agent critics)."""
        return False

    def _prompted_count(self) -> int:
        """How many formatters (one per agent)."""
        return self.num_agents

    def _broadcast_modules(self) -> list[torch.nn.Module]:
        """Modules every process must start equal (rank 0's); a LoRA base once with every adapter."""
        return distinct_modules(self.agents)

    def _references(self) -> list[torch.nn.Module]:
        """Each agent's frozen initial policy when the reference KL is on (none otherwise)."""
        if not self.args.reference_kl_enabled:
            return []
        from .devices import DeviceScheduler, check_available

        devices = self.agent_devices if self.args.reference_devices is None else [
            check_available(d, "reference_devices")
            for d in DeviceScheduler.resolve_devices(self.args.reference_devices, len(self.agents),
                                                     kind="reference_devices")]
        self._reference_devices = list(devices)
        return [r for r in frozen_copies(self._policies(), devices, self.compute_dtype)]

    def _set_seed(self) -> None:
        from ..checkpoint.rng import set_seed

        set_seed(self.args.seed)

    def _optimizers(self, models: Sequence[torch.nn.Module], lr: Optional[float] = None):
        """One AdamW per model (fused where torch has it) and a linear-warmup schedule each."""
        args = self.args
        optimizers, schedulers = [], []
        for model in models:
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                raise ConfigError(f"{type(model).__name__} has no trainable parameter (all requires_grad=False); "
                                  "unfreeze what the agent should learn.")
            fused = True if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) else None
            own_parameters(params)
            opt = torch.optim.AdamW(params, lr=lr if lr is not None else args.agent_learning_rate,
                                    betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                    weight_decay=args.weight_decay, fused=fused)
            allocate_adam_state(opt)  # the first step's allocation, here instead of inside the first step
            warmup = args.warmup_steps
            optimizers.append(opt)
            schedulers.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1))))
        return optimizers, schedulers

    def _vllm_options(self) -> dict[str, Any]:
        return {"gpu_memory_utilization": self.args.vllm_gpu_memory_utilization,
                "mixed_precision": self.args.mixed_precision, "engine_kwargs": self.args.vllm_engine_kwargs}

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype sampling and the frozen reference compute in with ``mixed_precision="bf16"``
        (bfloat16; sharded agents are cast by FSDP2's MixedPrecisionPolicy instead), else None."""
        return torch.bfloat16 if self.args.mixed_precision == "bf16" and not self.sharded else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast(bfloat16)`` on every device type the agents use, with
        ``mixed_precision="bf16"``; nothing otherwise."""
        stack = contextlib.ExitStack()
        if self.args.mixed_precision == "bf16":
            for device_type in sorted({d.type for d in self.agent_devices}):
                stack.enter_context(torch.autocast(device_type=device_type, dtype=torch.bfloat16))
        return stack

    @contextlib.contextmanager
    def policy_compute(self, agent: int) -> Iterator[tuple[torch.nn.Module, AutocastFactory]]:
        """``(module, autocast)``: what agent ``agent``'s policy forwards of the update run on
        (the loss and its log-probs; pass both to :func:`~comlrl.engine.step.policy_backward` or
        :func:`~comlrl.engine.step.rows_log_probs`), for the duration of the block.

        With ``mixed_precision="bf16"`` and a compute copy (the bfloat16 weights the agent samples
        with, :mod:`comlrl.rollout.compute`): that copy, current, without autocast; the gradients
        of its backwards land in the float32 masters' ``.grad``
        (:meth:`~comlrl.rollout.compute.ComputeCopy.trained`). Otherwise (float32, LoRA agents,
        agents that sample through ``model.generate``, sharded agents, the vLLM backend): the
        policy itself under :meth:`autocast`."""
        policy = self._policies()[agent]
        copy = getattr(self.backend, "compute_copy", lambda _: None)(agent)
        if copy is None or copy.master is not policy:
            yield policy, self.autocast
            return
        with copy.trained() as module:
            yield module, contextlib.nullcontext

    # ------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------
    @property
    def env_step(self) -> int:
        """Joint actions scored so far: the step metrics are logged at."""
        return self.state.env_step

    def _table(self, split: str) -> PromptTable:
        """The formatted prompts of ``train_dataset`` / ``eval_dataset`` (rebuilt if replaced)."""
        dataset = self.train_dataset if split == "train" else self.eval_dataset
        if dataset is None:
            raise ConfigError("training requires a train_dataset; set trainer.train_dataset or pass train_dataset=..."
                              if split == "train" else "evaluation requires an eval_dataset.")
        cached = self._tables.get(split)
        if cached is None or cached[0] != id(dataset):
            table = PromptTable.build(dataset, f"{split}_dataset", self.formatters)
            other = self._tables.get("eval" if split == "train" else "train")
            if other is not None and other[1].chat != table.chat:
                raise ConfigError("eval_dataset and train_dataset give an agent prompts of different forms (chat "
                                  "messages vs plain strings); use one form for both.")
            self._tables[split] = (id(dataset), table)
            self._fingerprint_cache = None
        return self._tables[split][1]

    def _batch(self, table: PromptTable, indices: Sequence[int]) -> PromptBatch:
        return PromptBatch(tuple(indices), tuple(table.item(i) for i in indices),
                           tuple(tuple(table.prompts[a][i] for i in indices) for a in range(len(table.prompts))))

    def _collector(self, table: PromptTable) -> Collector:
        return Collector(backend=self.backend, sampling=SamplingParams(self.args.max_new_tokens,
                                                                       self.args.temperature, self.args.top_p,
                                                                       self.args.top_k),
                         tokenizers=self.tokenizers, eos_token_ids=self._resolved.eos_token_ids, chat=table.chat,
                         formatters=self.formatters, reward=self.reward, transition=self.transition,
                         joint_mode=getattr(self.args, "joint_mode", "aligned"),
                         passthrough=self.args.external_prompt_passthrough, autocast=self.autocast)

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices of ``epoch`` in training order (a pure function of seed and epoch)."""
        n = len(self._table("train"))
        if self.args.shuffle:
            return stream_rng(self.args.seed, Stream.DATA_ORDER, epoch).permutation(n).tolist()
        return list(range(n))

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """The training rows, one per batch, in dataset order (CoMLRL's loader)."""
        if self.train_dataset is None:
            raise ConfigError("get_train_dataloader needs a train_dataset.")
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=1, shuffle=False, collate_fn=list)

    def get_eval_dataloader(self) -> Optional[torch.utils.data.DataLoader]:
        """The eval rows in batches of ``eval_batch_size``, or None without an eval_dataset."""
        if self.eval_dataset is None:
            return None
        return torch.utils.data.DataLoader(self.eval_dataset, batch_size=self.args.eval_batch_size, shuffle=False,
                                           collate_fn=list)

    # ------------------------------------------------------------------------------------------
    # the algorithm: the hooks a trainer family implements (docs/extending.md)
    # ------------------------------------------------------------------------------------------
    def trained_slots(self) -> Slots:
        """Every trained module with its optimizer and scheduler, by checkpoint slot (``agent-i``;
        a family adds its own, e.g. ``critic-i``). Whatever is here is checkpointed, resumed,
        fingerprinted and exported; its folder is laid out by :mod:`comlrl.engine.layouts`."""
        return Slots({f"agent-{i}": m for i, m in enumerate(self.agents)},
                     {f"agent-{i}": o for i, o in enumerate(self.optimizers)},
                     {f"agent-{i}": s for i, s in enumerate(self.schedulers)})

    def train_buffer(self, indices: list[int], epoch: int, timer: PhaseTimer) -> dict[str, float]:
        """Train on one buffer of prompts (``indices`` into the train table): play its episodes
        (:meth:`collect`, this process's share), then one optimizer step (:meth:`optimizer_step`)
        per ``train_batch_size`` prompts, :meth:`update_passes` times over the buffer. Returns the
        buffer's metrics and advances ``global_step`` / ``env_step``.

        The played buffer and its finished steps are kept on the trainer until the buffer is done,
        so train() called again after an interruption redoes only the interrupted step: a step
        whose :meth:`optimizer_step` returned is kept in ``buffer.finished_step`` (the engine's
        alone) until it is counted; what the family finished of an unfinished step is in its own
        ``buffer.step_parts``. Both are cleared when the step is counted.
        """
        order = self._buffer_order(indices, epoch)
        size = self._step_prompts()
        chunks = [order[i:i + size] for i in range(0, len(order), size)]
        mine = [dist.shard(c, self.dist) for c in chunks]
        buffer = self._buffer
        if buffer is None or (buffer.epoch, buffer.indices) != (epoch, indices):
            buffer = self._buffer = self.collect([i for part in mine for i in part], epoch, timer)
            buffer.epoch, buffer.indices = epoch, list(indices)
        offsets = [sum(len(m) for m in mine[:c]) for c in range(len(chunks))]
        buffer.steps = [range(offsets[c], offsets[c] + len(mine[c])) for c in range(len(chunks))]
        while buffer.steps_done < self.update_passes() * len(chunks):
            with timer("update"):
                if buffer.finished_step is None:  # a step finished before an interruption is not redone
                    buffer.finished_step = self.optimizer_step(buffer, buffer.steps[buffer.steps_done % len(chunks)])
            buffer.step_metrics.append(buffer.finished_step)
            buffer.steps_done += 1
            buffer.step_parts = buffer.finished_step = None
        self._buffer = None
        merged = merge_records([buffer.record] if buffer.turns else [], self.args.num_turns, self.num_agents, self.dist)
        self.state.env_step += sum(len(r) for turn in merged["rewards"] for r in turn)
        metrics = episode_metrics(merged, "train", "")
        metrics.update(buffer.extra_metrics)
        for key in set().union(*buffer.step_metrics):
            values = [m[key] for m in buffer.step_metrics if key in m]
            metrics[key] = sum(values) if key.endswith("skipped_steps") else sum(values) / len(values)
        return metrics

    def step_modules(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                     schedulers: Sequence[Any], count: bool = True, names: Optional[Sequence[str]] = None,
                     applied: Sequence[str] = ()) -> tuple[dict[str, float], Optional[list[float]]]:
        """The optimizer step of every trained module, once their gradients are in: wait for the
        checkpoint being written, sum gradients over processes, check, clip, step (see
        :func:`comlrl.engine.step.apply_gradients`), refresh the rollout backend's weights.
        Returns the step's metrics and each module's gradient norm (None: the step was skipped).
        ``count=False``: one part of an optimizer step that updates modules one after another (the
        family then adds 1 to ``state.global_step`` itself); ``names`` name the modules and
        ``applied`` the parts this step already updated, in a non-finite gradient's error."""
        learning_rate = schedulers[0].get_last_lr()[0]  # the rate this step is taken with
        self._settle_checkpoint()
        norms = apply_gradients(models, optimizers, schedulers, self.args.max_grad_norm, self.dist,
                                self.args.nonfinite, f"optimizer step {self.state.global_step + 1}", names=names,
                                applied=applied)
        self.backend.mark_stale(self._policies_of(models))
        if norms is None:
            return {"train/learning_rate": learning_rate, "train/skipped_steps": 1.0}, None
        self.state.global_step += int(count)
        return {"train/learning_rate": learning_rate}, norms

    def _buffer_order(self, indices: list[int], epoch: int) -> list[int]:
        """The buffer's prompts in the order they are split into optimizer steps."""
        return list(indices)

    def collect(self, mine: list[int], epoch: int, timer: PhaseTimer) -> PlayedBuffer:
        """The rollout, score and advantage phases of one buffer: this process's prompts ``mine``
        (indices into the train table, in optimizer-step order), played with
        :meth:`play_episodes`, and whatever the family's :meth:`optimizer_step` needs in
        ``PlayedBuffer.data`` (the family's own dataclass, or any object). Time each phase with
        ``timer("name")``."""
        raise NotImplementedError

    def optimizer_step(self, buffer: PlayedBuffer, groups: range) -> dict[str, float]:
        """The update phase of one optimizer step: the prompts ``groups`` (positions in ``mine`` of
        :meth:`collect`; ``buffer.steps`` lists every step's) are back-propagated, then
        :meth:`step_modules` steps the optimizers. Returns the step's metrics (averaged over the
        buffer's steps when logged). A step that updates modules one after another keeps what it
        finished in ``buffer.step_parts`` (None at the step's start), so that a call after an
        interruption redoes only the rest."""
        raise NotImplementedError

    def play_episodes(self, mine: list[int], epoch: int, timer: Optional[PhaseTimer] = None,
                      num_generations: Optional[int] = None) -> list[Any]:
        """Sample and score the episodes of the training prompts ``mine`` for ``epoch``: every
        agent samples ``num_generations`` (default the config's) completions per node of every
        turn, batched; rewards come from the reward function, next prompts from the transition.
        Each completion has its own seeded generator, so the result does not depend on batching
        or the number of processes. Returns one ``Turn`` per turn played (``comlrl.extend``)."""
        table = self._table("train")
        with self._sampling():  # every process enters (a collective when sharded), with prompts or without
            if not mine:
                return []
            return self._collector(table).play(
                self._batch(table, mine), num_generations=num_generations or self.args.num_generations,
                num_turns=self.args.num_turns, seed_of=train_seeds(self.args.seed, epoch),
                threshold=self.args.early_termination_threshold, timer=timer)

    def reference_log_probs(self, agent: int) -> Callable[[Rollout], torch.Tensor]:
        """The reference policy's log-probs of a rollout's tokens: the agent's frozen initial copy,
        or for a LoRA agent its shared base with adapters disabled."""
        model = self._policies()[agent]
        reference = self.reference_models[agent]

        def logp(ro: Rollout) -> torch.Tensor:
            target = reference if reference is not None else model
            device = next(target.parameters()).device
            disabled = model.reference() if reference is None else contextlib.nullcontext()
            with torch.no_grad(), self.autocast(), disabled:
                out = sequence_log_probs(target, ro.prompt_ids.to(device), ro.prompt_mask.to(device),
                                         ro.completion_ids.to(device), self.args.temperature)
            return out.to(ro.prompt_ids.device)
        return logp

    def fingerprint_extra(self) -> dict[str, Any]:
        """Family-specific parts of the fingerprint: what a resumed run must share with this one
        beyond the config, models, tokenizers, data and functions (e.g. a LoRA base, a critic)."""
        return {}

    def _reset_pending(self) -> None:
        """Forget the work of an interrupted buffer (a resume replaces the state it was played with)."""
        self._buffer = None

    # ------------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Optional[Union[str, os.PathLike]] = None,
              checkpoint_dir: Optional[Union[str, os.PathLike]] = None, checkpoint_interval: int = 1,
              checkpoint_total_limit: Optional[int] = None, save_steps: Optional[int] = None,
              **kwargs: Any) -> dict[str, float]:
        """Train until ``num_train_epochs`` epochs (of the whole run) are complete.

        Args:
            resume_from_checkpoint: a ``checkpoint-N`` directory (comlrl's, or one written by CoMLRL
                1.4.3) to continue from: the same run, its W&B run, its metrics file.
            checkpoint_dir: where ``checkpoint-N`` directories and ``metrics.jsonl`` go. The run holds
                an exclusive lock on it until train() returns.
            checkpoint_interval: save after every this many epochs (with a checkpoint_dir).
            checkpoint_total_limit: keep only the newest this many checkpoints of this run.
            save_steps: also save at the first buffer boundary after every this many optimizer steps.
        Returns:
            The last logged metrics row.

        Calling train() again on the same trainer after it was interrupted (an exception, Ctrl-C)
        continues exactly where it stopped: the interrupted optimizer step's partial gradients are
        discarded and redone, and no logged row is lost.
        """
        if kwargs:
            raise ConfigError(f"train() got generation keyword argument(s) {sorted(kwargs)}; comlrl samples with its "
                              "config: set max_new_tokens, temperature, top_p and top_k in the config instead.")
        self._check_open()
        self.args.validate()
        check_train_args(checkpoint_dir, checkpoint_interval, checkpoint_total_limit, save_steps)
        self._check_ready()
        self._check_training_inputs()
        self._table("train")
        self._check_world()
        resumed = self._load_for_train(resume_from_checkpoint) if resume_from_checkpoint is not None else None
        for opt in self.optimizers:  # an interrupted step's partial gradients must not leak into the next
            opt.zero_grad(set_to_none=True)
        # Weights changed since the last call (load_state_dict, a reward model sharing a backbone)
        # reach the compute copies and engines before they sample or train.
        self.backend.mark_stale()
        continuing = resumed is not None or self.state.global_step > 0
        loop = RunLoop(self, checkpoint_dir, checkpoint_interval, checkpoint_total_limit, save_steps,
                       resumed_number=resumed, continuing=continuing)
        return loop.run()

    def _check_ready(self) -> None:
        """Before sampling (train, evaluate): what construction accepts for CoMLRL's sake (minimal
        tokenizers, a max_new_tokens beyond a model's context) must be usable now."""
        check_tokenizers_usable(self.tokenizers)
        check_context(self._policies(), self.args.max_new_tokens)

    def _check_training_inputs(self) -> None:
        """What only training needs, checked before anything is opened (a family's: an API key);
        building a trainer (to export its agents) or evaluating does not need it."""

    def _check_world(self) -> None:
        if self.dist.enabled and self._step_prompts() < self.dist.world_size:
            raise ConfigError(f"{self.dist.world_size} processes share each optimizer step's prompts, but "
                              f"train_batch_size={self.args.train_batch_size} gives a step {self._step_prompts()} "
                              "prompt(s): some processes would never get one. Set train_batch_size so that a step "
                              f"has at least {self.dist.world_size} prompts, or launch fewer processes.")

    def close(self) -> None:
        """Finish any checkpoint write, unlock the checkpoint directory, stop rollout engines and
        writer threads. The trainer cannot train afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self.checkpoints.close()
        finally:
            self.backend.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TrainingError(f"this {type(self).__name__} was closed; build a new trainer (and resume from its "
                                "checkpoint) to train again.")

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- trackers (the loop's, through LoopTrainer.open_run_trackers) ----------------------------
    def open_run_trackers(self, folder: os.PathLike, resumed: bool,
                          keep_at_boundary: Callable[[dict[str, Any]], bool]) -> list[Tracker]:
        """The run's trackers (``report_to``), continuing their runs when ``resumed``; their
        identities are kept for the next checkpoint."""
        names = active_trackers(self.args.report_to, self.wandb_config)
        run_config = {**self.args.to_dict(), "model_name": self.model_name, "num_agents": self.num_agents,
                      "algorithm": self.algorithm_name, **self._run_config_extra()}
        if self.dataset_type is not None:  # recorded as CoMLRL 1.3.9-1.4.2 recorded it
            run_config["dataset_type"] = self.dataset_type
        ctx = TrackerContext(folder=Path(folder), run_id=self.run_id,
                             resume_step=self.state.env_step if resumed else None, run_config=run_config,
                             identities={"wandb": self.wandb_identity, **self.tracker_identities},
                             keep_at_boundary=keep_at_boundary)
        trackers = open_trackers(names, self.args, self.wandb_config, ctx)
        for tracker in trackers:
            identity = tracker.identity()
            if identity is None:
                continue
            if tracker.name == "wandb":  # CoMLRL's own field of the checkpoint
                self.wandb_identity = identity
            else:
                self.tracker_identities[tracker.name] = identity
        return trackers

    def _run_config_extra(self) -> dict[str, Any]:
        return {}
