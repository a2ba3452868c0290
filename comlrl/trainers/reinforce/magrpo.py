"""MAGRPOTrainer: the training loop only. Each phase lives in its own module.

One optimizer step::

    rollout    each agent samples K completions per prompt, batched   (comlrl.rollout)
    score      the reward function scores the aligned joint actions     (comlrl.rewards)
    advantage  return minus the group baseline                         (comlrl.advantages)
    update     per agent: masked policy-gradient loss, backward, AdamW  (comlrl.losses)
    log / checkpoint                                                    (comlrl.logging, comlrl.checkpoint)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import re
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ... import checkpoint as ckpt
from ... import distributed as dist
from ..._io import fsync_tree, move_into_place
from ...adapters import AdapterAgent, base_fingerprint, build_lora_agents, starts_at_base
from ...advantages import group_advantages
from ...exceptions import CheckpointDirError, ConfigError, DataError, ResumeMismatchError, TokenizerError
from ...fingerprint import (callable_fingerprint, compare_fingerprints, dataset_fingerprint, model_fingerprint,
                            tokenizer_fingerprint)
from ...episode import ExternalTransition, Node, Turn, discounted_returns, tree_size
from ...joint import cross_combinations, cross_returns, joint_actions_per_group
from ...logging import JsonlSink, WandbSink, check_wandb_config
from ...losses import kl_penalty, policy_gradient_loss, sequence_log_probs
from ...rewards import RewardFunction
from ...rollout import Rollout, SamplingParams, TransformersRollout, derive_seed
from ...timing import PhaseTimer
from ...utils import set_seed
from .config import RESUMABLE_FIELDS, MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig

logger = logging.getLogger("comlrl")

# Keep the last checkpoint snapshot's host-memory buffers for the next save up to this size (a
# fresh copy each time page-faults its way in); larger states are copied afresh and released.
REUSE_SNAPSHOT_BYTES = 2 * 2**30
# What runs did before a setting existed, where that differs from the setting's default now.
LEGACY_SETTINGS = {"rollout_backend": "hf"}

__all__ = ["MAGRPOTrainer", "MAREINFORCETrainer", "MARLOOTrainer", "MAReMaxTrainer"]


@dataclass
class TrainState:
    """Counters of a run; saved in every checkpoint (JSON)."""

    epoch: int = 0                 # completed epochs
    step_in_epoch: int = 0         # micro-batches done in the current epoch
    global_step: int = 0           # optimizer steps taken
    env_step: int = 0              # joint actions scored
    checkpoint: int = 0            # number of the last checkpoint saved
    log_window: dict[str, float] = field(default_factory=dict)  # metric sums since the last log
    log_window_counts: dict[str, int] = field(default_factory=dict)  # steps that reported each metric


@dataclass
class StepBatch:
    """The prompts of one micro-batch, as each agent sees them."""

    indices: list[int]             # dataset row of each group
    rows: list[dict[str, Any]]     # G dataset rows
    prompts: list[list[str]]       # [num_agents][G] formatted prompts


class MAGRPOTrainer:
    """Multi-Agent Group Relative Policy Optimization for N cooperating causal LMs.

    Args:
        agent_model: a model path / hub name, or a model, copied into ``num_agents`` agents.
        agents: the agent models (any ``transformers`` causal LM), instead of ``agent_model``.
        num_agents: how many copies of ``agent_model`` (default 2).
        tokenizer: one tokenizer for all agents, or a list with one per agent. Loaded from
            ``agent_model`` when that is a path and no tokenizer is given.
        reward_func: ``f(completions1, ..., completionsN) -> list[float]``, one value per joint
            action (see :class:`comlrl.rewards.RewardFunction` for the accepted conventions).
        train_dataset: a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column (or any
            columns, given ``formatters``).
        args: a :class:`MAGRPOConfig` (defaults if None).
        wandb_config: keyword arguments for ``wandb.init``; None = no W&B.
        formatters: ``f(row) -> str``, one shared or a list with one per agent.
        reward_processor: ``f(float) -> float`` applied to every reward.
        eval_dataset: rows for :meth:`evaluate` (same columns as ``train_dataset``); evaluated every
            ``eval_interval`` optimizer steps during training when that is > 0.
        external_transition: for ``num_turns > 1``: turns a joint answer into the agents' next
            prompts (see :class:`comlrl.episode.ExternalTransition` for its keyword arguments).
        peft_config: a ``peft.LoraConfig``: the ``num_agents`` agents become LoRA adapters on ONE
            frozen base, ``agent_model`` (loaded once from a path, or the given model itself, which
            peft wraps in place; see :mod:`comlrl.adapters`); checkpoints then hold the adapters and
            their optimizer state only, and the base by fingerprint.
    """

    config_class: type[MAGRPOConfig] = MAGRPOConfig
    advantage_mode: Optional[str] = None  # fixed by the named variants below

    def __init__(
        self,
        agent_model: Union[str, os.PathLike, torch.nn.Module, None] = None,
        agents: Optional[Sequence[torch.nn.Module]] = None,
        num_agents: Optional[int] = None,
        tokenizer: Any = None,
        reward_func: Optional[Callable[..., Sequence[float]]] = None,
        train_dataset: Any = None,
        args: Optional[MAGRPOConfig] = None,
        wandb_config: Optional[Mapping[str, Any]] = None,
        formatters: Union[Callable[[Mapping[str, Any]], str], Sequence[Callable], None] = None,
        reward_processor: Optional[Callable[[float], float]] = None,
        eval_dataset: Any = None,
        external_transition: Optional[Callable[..., Sequence[str]]] = None,
        peft_config: Any = None,
    ):
        if args is None:
            args = self.config_class()
        if not isinstance(args, MAGRPOConfig):
            raise ConfigError(f"args must be a MAGRPOConfig, got {type(args).__name__}.")
        if self.advantage_mode is not None and args.advantage_mode != self.advantage_mode:
            raise ConfigError(f"{type(self).__name__} trains with advantage_mode={self.advantage_mode!r} (use "
                              f"{self.config_class.__name__}); got {args.advantage_mode!r}. Use MAGRPOTrainer for "
                              "other baselines.")
        self.args = args
        self.wandb_config = check_wandb_config(wandb_config)
        wanted = [args.device] if args.agent_devices is None else list(args.agent_devices)
        self.dist = dist.init_distributed(  # one process unless launched by torchrun
            use_cuda=any(d is None or torch.device(d).type == "cuda" for d in wanted))
        self.agents, tokenizer = self._resolve_agents(agent_model, agents, num_agents, tokenizer, peft_config)
        self.num_agents = len(self.agents)
        self.tokenizers = self._resolve_tokenizers(tokenizer)
        self.eos_token_ids = [self._eos_ids(m, t) for m, t in zip(self.agents, self.tokenizers)]
        self.formatters = self._resolve_formatters(formatters)
        if reward_func is None:
            raise ConfigError("reward_func is required: f(completions1, ..., completionsN) -> list of floats.")
        self.reward = RewardFunction(reward_func, self.num_agents, reward_processor)
        self.joint_per_group = joint_actions_per_group(args.joint_mode, args.num_generations, self.num_agents)
        self.nodes_per_prompt, self.joint_per_prompt = tree_size(args.num_turns, self.joint_per_group)
        if self.joint_per_prompt > args.max_joint_actions:
            raise ConfigError(
                f"joint_mode={args.joint_mode!r} with num_generations={args.num_generations}, {self.num_agents} agents "
                f"and num_turns={args.num_turns} scores {self.joint_per_prompt} joint actions per prompt "
                f"({self.joint_per_group} per node (K**N in cross mode), {self.nodes_per_prompt} nodes), above "
                f"max_joint_actions={args.max_joint_actions}. Lower num_generations or num_turns, use "
                "joint_mode='aligned', or raise max_joint_actions."
            )
        if args.num_turns > 1 and external_transition is None:
            raise ConfigError(f"num_turns={args.num_turns} needs external_transition=f(agent_completions=..., ...) "
                              "returning the agents' next prompts; pass one or set num_turns=1.")
        self.transition = ExternalTransition(external_transition, self.num_agents) \
            if external_transition is not None else None
        if self.transition is not None and args.num_turns == 1:
            logger.warning("comlrl: external_transition is unused with num_turns=1.")
        self.chat_agents: list[Optional[bool]] = [None] * self.num_agents  # prompts are chat messages
        self.train_rows = self._resolve_dataset(train_dataset, "train_dataset")
        # Every row is formatted now, so a formatter or prompt problem stops the run before it starts.
        self.train_prompts = self._format_all(self.train_rows)
        self.eval_rows = self._resolve_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        self.eval_prompts = self._format_all(self.eval_rows) if self.eval_rows is not None else None
        if self.dist.enabled and args.train_batch_size < self.dist.world_size:
            raise ConfigError(
                f"{self.dist.world_size} processes share each micro-batch of train_batch_size="
                f"{args.train_batch_size} prompt(s): some would never get a prompt. train_batch_size counts the "
                f"prompts of a micro-batch across all processes; set it to at least {self.dist.world_size} "
                f"(a multiple of {self.dist.world_size} keeps every process equally busy), or launch fewer processes."
            )
        if self.dist.world_size > len(self.train_rows):
            raise ConfigError(f"{self.dist.world_size} processes but train_dataset has only {len(self.train_rows)} "
                              "prompt(s); launch at most as many processes as there are prompts.")
        if args.eval_interval and self.eval_rows is None:
            raise ConfigError(f"eval_interval={args.eval_interval} but no eval_dataset was given; pass "
                              "eval_dataset=... or set eval_interval=0.")
        if args.agent_devices is not None and len(args.agent_devices) != self.num_agents:
            raise ConfigError(f"agent_devices names {len(args.agent_devices)} device(s) for {self.num_agents} agents; "
                              "give exactly one per agent.")
        self.agent_devices = [self._resolve_device(d) for d in args.agent_devices] if args.agent_devices \
            else [self._resolve_device(args.device)] * self.num_agents
        shared = {}
        for model, device in zip(self.agents, self.agent_devices):
            if isinstance(model, AdapterAgent) and shared.setdefault(id(model.shared), device) != device:
                raise ConfigError(f"LoRA agents share one base model, so they run on one device; agent_devices "
                                  f"puts them on {shared[id(model.shared)]} and {device}. Give them the same "
                                  "device, or train full models to spread agents over devices.")
        self.device = self.agent_devices[0]  # timers synchronise here
        for model, device in zip(self.agents, self.agent_devices):
            model.to(device)
        # Every rank starts from rank 0's weights (a LoRA base once, with every adapter).
        shared_models = {id(m.shared): m.shared for m in self.agents if isinstance(m, AdapterAgent)}
        dist.broadcast_parameters([m for m in self.agents if not isinstance(m, AdapterAgent)]
                                  + list(shared_models.values()), self.dist)
        if args.reference_kl_coef and not all(starts_at_base(m) for m in self.agents if isinstance(m, AdapterAgent)):
            raise ConfigError("reference_kl_coef with LoRA agents takes the base model (adapters disabled) as each "
                              "agent's initial policy, but these adapters do not start at the base (their LoRA B "
                              "matrices are not zero: init_lora_weights?). Use peft's default init, or "
                              "reference_kl_coef=0.")
        # The KL penalty's reference: each agent's initial policy, frozen. Never checkpointed (a
        # resumed run rebuilds it from the same initial models, which the fingerprint checks).
        self.references: list[Optional[torch.nn.Module]] = [
            None if isinstance(m, AdapterAgent) else copy.deepcopy(m).eval().requires_grad_(False)
            for m in self.agents] if args.reference_kl_coef else [None] * self.num_agents
        set_seed(args.seed)
        self.optimizers = [
            torch.optim.AdamW(params, lr=args.agent_learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_epsilon, weight_decay=args.weight_decay, fused=_can_fuse(params))
            for params in (self._trainable(m) for m in self.agents)
        ]
        warmup = args.warmup_steps
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
            for opt in self.optimizers
        ]
        self.sampling = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
        self.rollout_engine = self._rollout_engine()
        self.state = TrainState()
        self.run_id = dist.gather_objects(uuid.uuid4().hex, self.dist)[0]  # rank 0's, on every rank
        # Checkpoint files are written by one background thread while training goes on (rank 0).
        self._checkpoint_writer: Optional[ThreadPoolExecutor] = None
        self._pending_save: Optional[Future] = None
        self._fingerprint_cache: Optional[dict[str, Any]] = None
        self._last_snapshot: Optional[ckpt.Snapshot] = None  # its buffers serve the next save
        self.wandb_identity: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------
    def _resolve_agents(self, agent_model, agents, num_agents, tokenizer, peft_config=None):
        if (agent_model is None) == (agents is None):
            raise ConfigError("Pass exactly one of agents=[model, ...] or agent_model=<path or model> (+ num_agents).")
        if peft_config is not None and agents is not None:
            raise ConfigError("peft_config makes the agents LoRA adapters on one shared base: pass "
                              "agent_model=<path or model> and num_agents instead of agents=[...].")
        if agents is not None:
            agents = list(agents)
            if not agents:
                raise ConfigError("agents is empty; pass at least one model.")
            if num_agents is not None and num_agents != len(agents):
                raise ConfigError(f"num_agents={num_agents} but {len(agents)} agents were given; drop num_agents.")
            for i, a in enumerate(agents):
                if not isinstance(a, torch.nn.Module):
                    raise ConfigError(f"agents[{i}] is a {type(a).__name__}, not a model; pass loaded models "
                                      "or use agent_model='path' with num_agents.")
            if len({id(a) for a in agents}) != len(agents):
                raise ConfigError("the same model object appears twice in agents; each agent needs its own copy "
                                  "(e.g. [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]).")
            return agents, tokenizer
        count = 2 if num_agents is None else num_agents
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"num_agents must be an int >= 1, got {num_agents!r}.")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if tokenizer is None and not isinstance(agent_model, torch.nn.Module):
            tokenizer = AutoTokenizer.from_pretrained(agent_model)
        if peft_config is not None:
            # One base in memory, one adapter per agent; adapters initialised from the run's seed.
            base = agent_model if isinstance(agent_model, torch.nn.Module) \
                else AutoModelForCausalLM.from_pretrained(agent_model)
            set_seed(self.args.seed)
            return build_lora_agents(base, peft_config, count), tokenizer
        if isinstance(agent_model, torch.nn.Module):
            return [agent_model] + [copy.deepcopy(agent_model) for _ in range(count - 1)], tokenizer
        return [AutoModelForCausalLM.from_pretrained(agent_model) for _ in range(count)], tokenizer

    def _resolve_tokenizers(self, tokenizer) -> list[Any]:
        if tokenizer is None:
            raise TokenizerError("tokenizer is required when agents are given as models; pass the tokenizer the "
                                 "agents were trained with (or a list with one per agent).")
        tokenizers = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer] * self.num_agents
        if len(tokenizers) != self.num_agents:
            raise TokenizerError(f"{len(tokenizers)} tokenizers for {self.num_agents} agents; pass one shared "
                                 "tokenizer or exactly one per agent.")
        for i, (tok, model) in enumerate(zip(tokenizers, self.agents)):
            if not callable(tok) or not hasattr(tok, "batch_decode"):
                raise TokenizerError(f"tokenizer for agent {i} is a {type(tok).__name__}, not a transformers tokenizer.")
            if tok.eos_token_id is None:
                raise TokenizerError(f"tokenizer for agent {i} has no eos_token; completions could never end. "
                                     "Set tokenizer.eos_token (e.g. to the model's end-of-text token).")
            if tok.pad_token_id is None:
                logger.warning("comlrl: tokenizer for agent %d has no pad token; using its eos token %r.", i,
                               tok.eos_token)
                tok.pad_token = tok.eos_token
            rows = model.get_input_embeddings().num_embeddings
            if len(tok) > rows:
                raise TokenizerError(
                    f"agent {i}'s tokenizer has {len(tok)} tokens but its model's embedding has only {rows} rows: "
                    "they do not belong together. Pass the matching tokenizer "
                    + ("(one per agent: tokenizer=[tok_a, tok_b, ...])." if not isinstance(tokenizer, (list, tuple))
                       else "for this agent.")
                )
        if not isinstance(tokenizer, (list, tuple)):
            sizes = {model.get_input_embeddings().num_embeddings for model in self.agents}
            if len(sizes) > 1:
                raise TokenizerError(
                    f"the agents have different vocabularies (embedding sizes {sorted(sizes)}) but share one "
                    "tokenizer; pass one tokenizer per agent: tokenizer=[tok_for_agent0, tok_for_agent1, ...]."
                )
        return tokenizers

    @staticmethod
    def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"{type(model).__name__} has no trainable parameter (all requires_grad=False); "
                              "unfreeze what the agent should learn.")
        return params

    @staticmethod
    def _eos_ids(model, tok) -> list[int]:
        ids = {tok.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        return sorted(i for i in ids if i is not None)

    def _resolve_formatters(self, formatters) -> list[Callable[[Mapping[str, Any]], str]]:
        if formatters is None:
            return [None] * self.num_agents  # type: ignore[list-item]
        if callable(formatters):
            return [formatters] * self.num_agents
        formatters = list(formatters)
        if len(formatters) != self.num_agents or not all(callable(f) for f in formatters):
            raise ConfigError(f"formatters must be one callable or a list of {self.num_agents} callables "
                              f"(one per agent), got {len(formatters)} item(s).")
        return formatters

    def _resolve_dataset(self, dataset, name: str) -> list[dict[str, Any]]:
        if dataset is None:
            raise DataError(f"{name} is required: a datasets.Dataset or a list of dicts with a 'prompt' column.")
        try:
            rows = [dict(r) for r in dataset]
        except (TypeError, ValueError) as exc:
            raise DataError(f"{name} must be a datasets.Dataset or a list of dicts; iterating it failed: {exc}")
        if not rows:
            raise DataError(f"{name} is empty; it needs at least one row.")
        if any(f is None for f in self.formatters):
            missing = [i for i, r in enumerate(rows) if "prompt" not in r]
            if missing:
                raise DataError(f"{name} row {missing[0]} has no 'prompt' column (columns: "
                                f"{sorted(rows[missing[0]])}); add one, or pass formatters=... that build the prompt.")
        return rows

    def _format_all(self, rows: list[dict[str, Any]]) -> list[list[Any]]:
        """``[num_agents][len(rows)]`` prompts as given: strings, or chat messages (rendered at sampling)."""
        prompts = [[self._format(a, row, i) for i, row in enumerate(rows)] for a in range(self.num_agents)]
        for a in range(self.num_agents):
            kinds = {isinstance(p, list) for p in prompts[a]}
            if len(kinds) > 1:
                raise DataError(f"agent {a} gets plain-string prompts for some rows and chat messages "
                                "for others; use one form for the whole dataset.")
            chat = kinds == {True}
            if self.chat_agents[a] is not None and self.chat_agents[a] != chat:
                raise DataError(f"eval_dataset and train_dataset give agent {a} prompts of different forms "
                                "(chat messages vs plain strings); use one form for both.")
            self.chat_agents[a] = chat
            if chat:
                self._render(a, prompts[a][0])  # a missing chat template fails now, not mid-run
        return prompts

    def _render(self, agent: int, prompt: Any) -> str:
        """The text agent ``agent`` is sampled from: a chat agent's messages (or a later turn's text,
        as one user message) rendered with its chat template, ending with the assistant's turn."""
        if not self.chat_agents[agent]:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        tokenizer = self.tokenizers[agent]
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError(f"the prompts of agent {agent} are chat messages but its tokenizer has no "
                                 "chat_template; pass plain-string prompts or a tokenizer with a chat template.")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _format(self, agent: int, row: Mapping[str, Any], index: int) -> Union[str, list[dict[str, Any]]]:
        """A row's prompt for ``agent``: a string, or chat messages ``[{"role", "content"}, ...]``."""
        formatter = self.formatters[agent]
        try:
            prompt = row["prompt"] if formatter is None else formatter(row)
        except Exception as exc:
            raise DataError(f"formatter of agent {agent} failed on dataset row {index}: {type(exc).__name__}: {exc}") from exc
        if isinstance(prompt, list) and prompt and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            return [dict(m) for m in prompt]
        if not isinstance(prompt, str):
            raise DataError(f"the prompt of agent {agent} for dataset row {index} is a {type(prompt).__name__}, "
                            f"neither a string nor chat messages [{{'role': ..., 'content': ...}}]: {prompt!r:.80}. " +
                            ("Fix the 'prompt' column." if formatter is None else "Make the formatter return str."))
        if not prompt:
            raise DataError(f"the prompt of agent {agent} for dataset row {index} is empty; every prompt needs text.")
        return prompt

    @staticmethod
    def _resolve_device(name: Optional[str]) -> torch.device:
        if name is None:  # the current CUDA device: cuda:LOCAL_RANK under torchrun
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ConfigError(f"device {name!r} is not a valid torch device: {exc}") from exc
        if device.type == "cuda" and (not torch.cuda.is_available() or
                                      (device.index or 0) >= torch.cuda.device_count()):
            raise ConfigError(f"device {name!r} is not available here; use 'cpu' or leave device=None.")
        return device

    # ------------------------------------------------------------------------------------------
    # data order
    # ------------------------------------------------------------------------------------------
    def _epoch_micro_batches(self, epoch: int) -> list[list[int]]:
        """Dataset indices of each micro-batch of ``epoch`` (a pure function of seed and epoch)."""
        n = len(self.train_rows)
        order = np.random.default_rng([self.args.seed, epoch]).permutation(n) if self.args.shuffle else np.arange(n)
        size = self.args.train_batch_size
        return [order[i:i + size].tolist() for i in range(0, n, size)]

    def _steps_per_epoch(self) -> int:
        return math.ceil(len(self._epoch_micro_batches(0)) / self.args.gradient_accumulation_steps)

    def _make_batch(self, indices: list[int], split: str = "train") -> StepBatch:
        source_rows, source_prompts = (self.train_rows, self.train_prompts) if split == "train" \
            else (self.eval_rows, self.eval_prompts)
        rows = [source_rows[i] for i in indices]
        prompts = [[source_prompts[a][i] for i in indices] for a in range(self.num_agents)]
        return StepBatch(indices, rows, prompts)

    # ------------------------------------------------------------------------------------------
    # phases
    # ------------------------------------------------------------------------------------------
    def _train_seed(self, epoch: int) -> Callable[[int, Node, int], int]:
        """Training samples: seeded by (seed, agent, epoch, example, generation[, tree path])."""
        def seed_of(agent: int, node: Node, generation: int) -> int:
            path = (node.path,) if node.path else ()
            return derive_seed(self.args.seed, "train", agent, epoch, node.index, generation, *path)
        return seed_of

    def _eval_seed(self, agent: int, node: Node, generation: int) -> int:
        path = (node.path,) if node.path else ()
        return derive_seed(self.args.seed, "eval", agent, node.index, generation, *path)

    def _episode(self, batch: StepBatch, seed_of: Callable[[int, Node, int], int],
                 timer: Optional[PhaseTimer] = None) -> list[Turn]:
        """Play every turn of the micro-batch's episodes: rollout, score, transition (no update)."""
        timer = timer or PhaseTimer()
        n, joint = self.num_agents, self.joint_per_group
        nodes = [Node(g, idx, (), [batch.prompts[a][g] for a in range(n)], [[batch.prompts[a][g]] for a in range(n)],
                      [[] for _ in range(n)]) for g, idx in enumerate(batch.indices)]
        turns: list[Turn] = []
        for turn_number in range(1, self.args.num_turns + 1):
            with timer("rollout"):
                rollouts = self._sample_nodes(nodes, seed_of)
            with timer("score"):
                completions = self._joint_completions(rollouts, len(nodes))
                rewards = self._score_nodes(nodes, completions, batch, turn_number)
            turn = Turn(nodes, rollouts, rewards)
            turns.append(turn)
            children: list[Node] = []
            for i, node in enumerate(nodes):
                for j in range(joint):
                    r = float(rewards[i * joint + j])
                    ended = turn_number == self.args.num_turns or (
                        self.args.termination_threshold is not None and r >= self.args.termination_threshold)
                    if ended:
                        turn.children.append(None)
                        continue
                    answer = [completions[a][i * joint + j] for a in range(n)]
                    with timer("transition"):
                        prompts = self.transition(node, answer, batch.rows[node.group], turn_number)
                    turn.children.append(len(children))
                    children.append(Node(node.group, node.index, node.path + (j,), prompts,
                                         [h + [p] for h, p in zip(node.prompt_history, prompts)],
                                         [h + [c] for h, c in zip(node.response_history, answer)]))
            if not children:
                break
            nodes = children
        return turns

    def _sample_nodes(self, nodes: list[Node], seed_of: Callable[[int, Node, int], int]) -> list[Rollout]:
        """Each agent's K completions for every node: one batched call per agent (or one for all
        agents together, when they can decode stacked; see :func:`comlrl.rollout.rollout_agents`)."""
        k = self.args.num_generations
        agents = range(self.num_agents)
        with self._autocast():
            return self.rollout_engine.sample(
                [[self._render(a, node.prompts[a]) for node in nodes] for a in agents],
                [[[seed_of(a, node, g) for g in range(k)] for node in nodes] for a in agents], self.sampling,
                self.eos_token_ids, [not self.chat_agents[a] for a in agents])

    def _rollout_engine(self) -> Any:
        """The rollout backend ``rollout_backend`` names (see :class:`comlrl.rollout.TransformersRollout`)."""
        if self.args.rollout_backend != "vllm":
            return TransformersRollout(self.agents, self.tokenizers, self.args.rollout_backend)
        if self.dist.world_size > 1:
            raise ConfigError(f"rollout_backend='vllm' runs in one process for now; this is process {self.dist.rank} "
                              f"of {self.dist.world_size}. Launch without torchrun, or use rollout_backend='auto'.")
        if any(isinstance(m, AdapterAgent) for m in self.agents):
            raise ConfigError("rollout_backend='vllm' does not serve LoRA agents yet (they would need vLLM's "
                              "multi-LoRA engine); use rollout_backend='auto', or train full models.")
        from ...vllm_backend import VLLMRollout
        return VLLMRollout(self.agents, self.tokenizers, seed=self.args.seed,
                           gpu_memory_utilization=self.args.vllm_gpu_memory_utilization,
                           mixed_precision=self.args.mixed_precision, engine_kwargs=self.args.vllm_engine_kwargs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast(bfloat16)`` on every device type the agents use, with
        ``mixed_precision="bf16"``; nothing otherwise."""
        stack = contextlib.ExitStack()
        if self.args.mixed_precision == "bf16":
            for device_type in sorted({d.type for d in self.agent_devices}):
                stack.enter_context(torch.autocast(device_type=device_type, dtype=torch.bfloat16))
        return stack

    def _joint_completions(self, rollouts: list[Rollout], num_nodes: int) -> list[list[str]]:
        """``[N][nodes * J]``: agent a's completion in each joint action, node-major.

        Aligned: joint action k of node i is row i*K+k of every agent. Cross: joint action j of node
        i combines, for each agent a, row i*K + combos[j, a] (see :mod:`comlrl.joint`).
        """
        if self.args.joint_mode == "aligned":
            return [list(r.texts) for r in rollouts]
        k = self.args.num_generations
        combos = cross_combinations(k, self.num_agents)
        return [[ro.texts[i * k + int(c)] for i in range(num_nodes) for c in combos[:, a]]
                for a, ro in enumerate(rollouts)]

    def _score_nodes(self, nodes: list[Node], completions: list[list[str]], batch: StepBatch, turn: int
                     ) -> torch.Tensor:
        """``[nodes * J]`` rewards, one reward call for the whole turn."""
        per_node = self.joint_per_group
        prompts = [(batch.rows[node.group].get("prompt", node.prompts[0]) if turn == 1 else node.prompts[0])
                   for node in nodes for _ in range(per_node)]
        items = [batch.rows[node.group] for node in nodes for _ in range(per_node)]
        return self.reward(completions, prompts, items)

    def _agent_returns(self, returns: torch.Tensor, num_nodes: int) -> list[torch.Tensor]:
        """Each agent's ``[nodes * K]`` completion returns from the joint-action returns."""
        if self.args.joint_mode == "aligned":
            return [returns] * self.num_agents
        per_agent = cross_returns(returns.reshape(num_nodes, self.joint_per_group), self.args.num_generations,
                                  self.num_agents)
        return list(per_agent)

    def _backward(self, agent: int, ro: Rollout, advantages: torch.Tensor, weight: float) -> tuple[float, float]:
        """Back-propagate ``weight *`` agent ``agent``'s loss on rollout ``ro``: the policy-gradient
        loss, plus ``reference_kl_coef *`` the KL to its initial policy when that is on.
        Returns (the loss, the KL) unweighted."""
        model = self.agents[agent]
        # Eval mode, as during sampling: the gradient must be that of the policy that sampled
        # (dropout would make it another policy's, biasing the ratio-1 on-policy loss).
        model.eval()
        with self._autocast():
            logp = sequence_log_probs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, self.args.temperature)
        loss = policy_gradient_loss(logp, advantages.to(logp.device), ro.completion_mask, self.args.loss_type,
                                    self.args.max_new_tokens)
        kl = 0.0
        if self.args.reference_kl_coef:
            penalty = kl_penalty(logp, self._reference_log_probs(agent, ro), ro.completion_mask, self.args.loss_type,
                                 self.args.max_new_tokens)
            loss = loss + self.args.reference_kl_coef * penalty
            kl = float(penalty.detach())
        (loss * weight).backward()
        return float(loss.detach()), kl

    def _reference_log_probs(self, agent: int, ro: Rollout) -> torch.Tensor:
        """``[R, T]`` log-probs of ``ro``'s completions under agent ``agent``'s initial policy: its
        frozen copy, or for a LoRA agent the shared base with adapters disabled (no copy)."""
        reference = self.references[agent]
        # An adapter agent's initial policy is the base: the agent itself with adapters disabled.
        disabled = self.agents[agent].reference() if reference is None else contextlib.nullcontext()
        with torch.no_grad(), self._autocast(), disabled:
            return sequence_log_probs(reference if reference is not None else self.agents[agent], ro.prompt_ids,
                                      ro.prompt_mask, ro.completion_ids, self.args.temperature)

    def _apply_gradients(self) -> list[float]:
        """Sum gradients over processes, then clip, step and zero every agent; returns the pre-clip
        gradient norms."""
        norms = []
        for model, opt, sched in zip(self.agents, self.optimizers, self.schedulers):
            dist.all_reduce_gradients(list(model.parameters()), self.dist)
            params = [p for p in model.parameters() if p.grad is not None]
            limit = self.args.max_grad_norm if self.args.max_grad_norm is not None else math.inf
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        self.rollout_engine.mark_stale()
        return norms

    def _loss_denominators(self, turns: list[Turn]) -> list[float]:
        """Per turn: rows, then each agent's scored tokens (zeros for turns not played here).

        Summed over processes, these turn each process's share of a micro-batch into exactly its
        part of the loss one process would compute on the whole micro-batch.
        """
        counts = [0.0] * (self.args.num_turns * (1 + self.num_agents))
        for t, turn in enumerate(turns):
            base = t * (1 + self.num_agents)
            counts[base] = float(len(turn.nodes))
            for a, ro in enumerate(turn.rollouts):
                counts[base + 1 + a] = float(ro.completion_mask.sum())
        return counts

    def _optimizer_step(self, micro_batches: list[list[int]], epoch: int, timer: PhaseTimer) -> dict[str, float]:
        """Episodes, returns, advantages and backward for each micro-batch, then one AdamW step per agent.

        Under torchrun each process plays its share of every micro-batch (:func:`comlrl.distributed.shard`)
        and weighs its loss by its share of the micro-batch's rows (or tokens, for ``token_mean``), so
        the gradients summed over processes equal the one-process gradient of the whole micro-batch.
        """
        total_groups = sum(len(mb) for mb in micro_batches)
        records = []
        losses = [0.0] * (2 * self.num_agents)  # agent a's objective at [a], its KL at [N + a]
        per_turn = 1 + self.num_agents
        for indices in micro_batches:
            mine = dist.shard(indices, self.dist)
            turns: list[Turn] = []
            if mine:
                batch = self._make_batch(mine)
                turns = self._episode(batch, self._train_seed(epoch), timer)
                with timer("advantage"):
                    returns = discounted_returns([t.rewards for t in turns], [t.children for t in turns],
                                                 self.joint_per_group, self.args.discount, self.args.num_turns)
                    advantages = [[group_advantages(r, t.rollouts[0].group_ids.cpu(), self.args.advantage_mode,
                                                    self.args.advantage_normalization)
                                   for r in self._agent_returns(g, len(t.nodes))] for t, g in zip(turns, returns)]
            local = self._loss_denominators(turns)
            totals = dist.all_reduce_sum(local, self.dist)
            total_rows = sum(totals[t * per_turn] for t in range(self.args.num_turns))
            with timer("update"):
                for t, turn in enumerate(turns):
                    # Every completion of every turn weighs the same in the micro-batch's loss.
                    share = totals[t * per_turn] / total_rows
                    for a, ro in enumerate(turn.rollouts):
                        d = t * per_turn + (1 + a if self.args.loss_type == "token_mean" else 0)
                        part = local[d] / totals[d] if totals[d] else 0.0  # this process's part of the loss
                        weight = share * len(indices) / total_groups * part
                        loss, kl = self._backward(a, ro, advantages[t][a], weight)
                        losses[a] += loss * part * share * len(indices)
                        losses[self.num_agents + a] += kl * part * share * len(indices)
            records.append({
                "rewards": [t.rewards for t in turns],
                "first_returns": returns[0] if turns else None,
                "lengths": [[ro.lengths.float().cpu() for ro in t.rollouts] for t in turns],
            })
        learning_rate = self.schedulers[0].get_last_lr()[0]  # the rate this step is taken with
        with timer("update"):
            grad_norms = self._apply_gradients()
        self.state.global_step += 1
        turn_rewards, first_returns, lengths, losses = self._merge_ranks(records, losses)
        for per_turn_rewards in turn_rewards:
            self.state.env_step += sum(len(r) for r in per_turn_rewards)
        all_rewards = torch.cat([r for per_turn_rewards in turn_rewards for r in per_turn_rewards])
        metrics = {
            "train/reward_mean": float(all_rewards.mean()),
            "train/reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "train/reward_min": float(all_rewards.min()),
            "train/reward_max": float(all_rewards.max()),
            "train/learning_rate": learning_rate,
        }
        if self.args.num_turns > 1:
            metrics["train/return_mean"] = float(torch.cat(first_returns).mean())
            for t, per_turn_rewards in enumerate(turn_rewards):
                if per_turn_rewards:
                    metrics[f"train/turn_{t + 1}/reward_mean"] = float(torch.cat(per_turn_rewards).mean())
        for a in range(self.num_agents):
            agent_lengths = torch.cat(lengths[a])
            metrics[f"agent_{a}/loss"] = losses[a] / total_groups
            if self.args.reference_kl_coef:
                metrics[f"agent_{a}/kl"] = losses[self.num_agents + a] / total_groups
            metrics[f"agent_{a}/completion_length"] = float(agent_lengths.mean())
            metrics[f"agent_{a}/completion_length_max"] = float(agent_lengths.max())
            metrics[f"agent_{a}/grad_norm"] = grad_norms[a]
        return metrics

    def _merge_ranks(self, records: list[dict[str, Any]], losses: Optional[list[float]] = None):
        """Every process's per-micro-batch results, in the order one process would have produced
        them (micro-batch, turn, then rank = group order): ``(turn_rewards[t] -> [tensor],
        first_returns -> [tensor], lengths[a] -> [tensor], summed losses)``."""
        gathered = dist.gather_objects((records, losses), self.dist)
        turn_rewards: list[list[torch.Tensor]] = [[] for _ in range(self.args.num_turns)]
        first_returns: list[torch.Tensor] = []
        lengths: list[list[torch.Tensor]] = [[] for _ in range(self.num_agents)]
        for m in range(len(records)):
            ranks = [rank_records[m] for rank_records, _ in gathered]
            first_returns.extend(r["first_returns"] for r in ranks if r["first_returns"] is not None)
            for t in range(self.args.num_turns):
                for r in ranks:
                    if t < len(r["rewards"]):
                        turn_rewards[t].append(r["rewards"][t])
                        for a in range(self.num_agents):
                            lengths[a].append(r["lengths"][t][a])
        summed = None
        if losses is not None:
            summed = [sum(rank_losses[i] for _, rank_losses in gathered) for i in range(len(losses))]
        return turn_rewards, first_returns, lengths, summed

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def evaluate(self, num_samples: Optional[int] = None) -> dict[str, float]:
        """Sample ``num_generations`` completions per eval prompt and score them; no update.

        Uses the first ``num_samples`` rows of ``eval_dataset`` (default ``eval_num_samples``, else
        all). Eval samples come from their own seeds (the same at every evaluation, so evaluations
        compare like with like), and every global random state is restored afterwards, so a run
        with evaluation trains to exactly the same weights as one without. During ``train()`` the
        result is logged under ``eval/`` at the current ``env_step``. Under torchrun every process
        must call it (each evaluates its share of the prompts; all get the same result).

        Returns:
            ``eval/reward_mean``, ``eval/reward_std``, ``eval/turn_1/reward_mean``,
            ``eval/return_mean`` and ``eval/agent_i/completion_length`` per agent.
        """
        if self.eval_rows is None:
            raise ConfigError("evaluate() needs an eval_dataset; pass eval_dataset=... to MAGRPOTrainer.")
        count = num_samples if num_samples is not None else self.args.eval_num_samples
        indices = list(range(min(count or len(self.eval_rows), len(self.eval_rows))))
        rng_json, rng_tensors = ckpt.capture_rng_state()
        records = []
        try:
            for start in range(0, len(indices), self.args.train_batch_size):
                mine = dist.shard(indices[start:start + self.args.train_batch_size], self.dist)
                turns = self._episode(self._make_batch(mine, "eval"), self._eval_seed) if mine else []
                records.append({
                    "rewards": [t.rewards for t in turns],
                    "first_returns": discounted_returns([t.rewards for t in turns], [t.children for t in turns],
                                                        self.joint_per_group, self.args.discount,
                                                        self.args.num_turns)[0] if turns else None,
                    "lengths": [[ro.lengths.float().cpu() for ro in t.rollouts] for t in turns],
                })
        finally:
            ckpt.restore_rng_state(rng_json, rng_tensors)
        turn_rewards, first_returns, lengths, _ = self._merge_ranks(records)
        all_rewards = torch.cat([r for per_turn in turn_rewards for r in per_turn])
        metrics = {
            "eval/reward_mean": float(all_rewards.mean()),
            "eval/reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "eval/return_mean": float(torch.cat(first_returns).mean()),
        }
        for t, per_turn in enumerate(turn_rewards):
            if per_turn:
                metrics[f"eval/turn_{t + 1}/reward_mean"] = float(torch.cat(per_turn).mean())
        for a in range(self.num_agents):
            metrics[f"eval/agent_{a}/completion_length"] = float(torch.cat(lengths[a]).mean())
        return metrics

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: Optional[Union[str, os.PathLike]] = None,
        checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
        checkpoint_interval: Optional[int] = None,
        checkpoint_total_limit: Optional[int] = None,
        save_steps: Optional[int] = None,
    ) -> dict[str, float]:
        """Train until ``num_train_epochs`` epochs are complete.

        Args:
            resume_from_checkpoint: a ``checkpoint-N`` directory to continue from (same run).
            checkpoint_dir: where ``checkpoint-N`` directories and ``metrics.jsonl`` go.
            checkpoint_interval: save after every this many epochs (default 1 with a checkpoint_dir).
            checkpoint_total_limit: keep only the newest this many checkpoints.
            save_steps: also save every this many optimizer steps inside an epoch.
        Returns:
            The last logged metrics.
        """
        self._check_train_args(checkpoint_dir, checkpoint_interval, checkpoint_total_limit, save_steps)
        if checkpoint_dir is not None and checkpoint_interval is None:
            checkpoint_interval = 1
        resumed_from = None
        if resume_from_checkpoint is not None:
            resumed_from = self._resume(Path(resume_from_checkpoint))
        dist.main_process_first_result(lambda: self._check_checkpoint_dir(checkpoint_dir), self.dist)
        total_epochs = self.args.num_train_epochs
        if self.state.epoch >= total_epochs:
            logger.warning("comlrl: %s already completed %d epoch(s) and num_train_epochs=%d; nothing to train. "
                           "Raise num_train_epochs to continue the run.", resumed_from, self.state.epoch, total_epochs)
            return {}
        metrics_path = Path(checkpoint_dir if checkpoint_dir is not None else self.args.output_dir) / "metrics.jsonl"
        # Metrics, W&B and the progress bar belong to rank 0; the others compute the same rows.
        sinks: list[Any] = [None, None]

        def open_sinks() -> None:
            sinks[0] = JsonlSink(metrics_path, run_id=self.run_id,
                                 keep_until_step=self.state.env_step if resumed_from else None)
            sinks[1] = self._open_wandb(resumed=resumed_from is not None)

        dist.main_process_first_result(open_sinks, self.dist)  # a failure stops every rank
        jsonl, wandb_sink = sinks
        last: dict[str, float] = {}
        steps_per_epoch = self._steps_per_epoch()
        prompts_per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
        logger.info("comlrl: %d agents, joint_mode=%s, %d turn(s): each optimizer step samples up to %d completions "
                    "per agent and scores up to %d joint actions (%d per prompt); %d steps per epoch.",
                    self.num_agents, self.args.joint_mode, self.args.num_turns,
                    prompts_per_step * self.nodes_per_prompt * self.args.num_generations,
                    prompts_per_step * self.joint_per_prompt, self.joint_per_prompt, steps_per_epoch)
        progress = _progress(total=total_epochs * steps_per_epoch, initial=self.state.global_step,
                             disable=not self.dist.is_main)
        try:
            while self.state.epoch < total_epochs:
                epoch = self.state.epoch
                micro = self._epoch_micro_batches(epoch)
                while self.state.step_in_epoch < len(micro):
                    timer = PhaseTimer(self.device)
                    start = self.state.step_in_epoch
                    chunk = micro[start:start + self.args.gradient_accumulation_steps]
                    metrics = self._optimizer_step(chunk, epoch, timer)
                    self.state.step_in_epoch += len(chunk)
                    epoch_done = self.state.step_in_epoch == len(micro)
                    if epoch_done:
                        self.state.epoch += 1
                        self.state.step_in_epoch = 0
                    metrics.update(timer.metrics())
                    evaluation = None
                    if self.args.eval_interval and self.state.global_step % self.args.eval_interval == 0:
                        eval_timer = PhaseTimer(self.device)
                        with eval_timer("eval"):
                            evaluation = self.evaluate()
                        evaluation.update(eval_timer.metrics())
                    logged = self._accumulate_and_log(metrics, epoch + (start + len(chunk)) / len(micro), jsonl,
                                                      wandb_sink, evaluation)
                    last = logged or last
                    progress.update(1)
                    progress.set_postfix(epoch=epoch + 1, reward=f"{metrics['train/reward_mean']:.3f}")
                    if checkpoint_dir is not None:
                        due_epoch = epoch_done and self.state.epoch % checkpoint_interval == 0
                        due_step = save_steps is not None and self.state.global_step % save_steps == 0
                        if due_epoch or due_step:
                            if jsonl is not None:
                                jsonl.sync()  # the rows up to this checkpoint survive a power cut
                            self._save(checkpoint_dir, checkpoint_total_limit)
                    if epoch_done:
                        break
            dist.main_process_first_result(self._wait_for_save, self.dist)  # the last checkpoint is on disk
        finally:
            self._drain_save()
            progress.close()
            if jsonl is not None:
                jsonl.close()
            if wandb_sink is not None:
                wandb_sink.close()
        return last

    def _accumulate_and_log(self, metrics: dict[str, float], epoch: float, jsonl: Optional[JsonlSink],
                            wandb_sink: Optional[WandbSink], evaluation: Optional[dict[str, float]] = None
                            ) -> Optional[dict[str, float]]:
        """Add a step's metrics to the window; write one row on logging steps and eval steps."""
        window, counts = self.state.log_window, self.state.log_window_counts
        for key, value in metrics.items():
            window[key] = window.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
        row: dict[str, float] = {}
        if self.state.global_step % self.args.logging_steps == 0:
            # Each metric averages the steps that reported it (a later turn may not occur every step).
            row = {key: value / counts[key] for key, value in sorted(window.items())}
            for key in ("train/reward_min", "train/reward_max"):  # extremes stay extremes (last step's)
                row[key] = metrics[key]
            self.state.log_window, self.state.log_window_counts = {}, {}
        row.update(evaluation or {})
        if not row:
            return None
        row.update(env_step=self.state.env_step, global_step=self.state.global_step, epoch=round(epoch, 6))
        if jsonl is not None:
            jsonl.log(row)
        if wandb_sink is not None:
            wandb_sink.log({k: v for k, v in row.items() if k != "env_step"}, step=self.state.env_step)
        return row

    # ------------------------------------------------------------------------------------------
    # saving for use
    # ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: Union[str, os.PathLike], merge_adapters: bool = False) -> Path:
        """Write every agent as a standard transformers directory, ``output_dir/agent_i``.

        Each holds the model and its tokenizer, so ``AutoModelForCausalLM.from_pretrained(output_dir
        / "agent_0")`` loads it back. LoRA agents are written as PEFT adapter directories
        (``PeftModel.from_pretrained(base, output_dir / "agent_0")``), or with
        ``merge_adapters=True`` as plain models with the adapter merged into a copy of the base.
        The whole directory is written to a hidden sibling and renamed into place: an interrupted
        save leaves the previous ``output_dir`` (if any) untouched. Under torchrun, every process
        calls it and rank 0 writes.
        """
        if not isinstance(merge_adapters, bool):
            raise ConfigError(f"merge_adapters must be True or False, got {merge_adapters!r}.")
        return dist.main_process_first_result(lambda: self._write_agents(Path(output_dir), merge_adapters),
                                              self.dist)

    def _write_agents(self, target: Path, merge_adapters: bool) -> Path:
        if target.exists() and (not target.is_dir() or any(not re.fullmatch(r"agent_\d+", p.name)
                                                           for p in target.iterdir())):
            raise ConfigError(f"save_model: {target} exists and holds more than agent_* folders (metrics, "
                              "checkpoints?); nothing was written. Choose an empty or new directory.")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        try:
            for i, (model, tokenizer) in enumerate(zip(self.agents, self.tokenizers)):
                if isinstance(model, AdapterAgent):
                    model.save_pretrained(tmp / f"agent_{i}", merged=merge_adapters)
                else:
                    model.save_pretrained(tmp / f"agent_{i}")
                tokenizer.save_pretrained(tmp / f"agent_{i}")
            fsync_tree(tmp)
            move_into_place(tmp, target)  # replaces an earlier save_model only after the new one is whole
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    # ------------------------------------------------------------------------------------------
    # W&B
    # ------------------------------------------------------------------------------------------
    def _open_wandb(self, resumed: bool) -> Optional[WandbSink]:
        if self.wandb_config is None:
            return None
        config = dict(self.wandb_config)
        if resumed and self.wandb_identity and "id" not in config:
            # The user did not pass the identity: continue the checkpoint's W&B run all the same.
            config.update(self.wandb_identity)
            config.setdefault("resume", "allow")
        run_config = {**self.args.to_dict(), "num_agents": self.num_agents}
        sink = WandbSink(config, run_config, min_step=self.state.env_step + 1 if resumed else 0)
        self.wandb_identity = sink.identity()
        return sink

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_train_args(checkpoint_dir, interval, limit, save_steps) -> None:
        for name, value in (("checkpoint_interval", interval), ("checkpoint_total_limit", limit),
                            ("save_steps", save_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be an int >= 1 or None, got {value!r}.")
        if checkpoint_dir is None and any(v is not None for v in (interval, limit, save_steps)):
            raise ConfigError("checkpoint_interval / checkpoint_total_limit / save_steps need a checkpoint_dir.")

    def _check_checkpoint_dir(self, checkpoint_dir) -> None:
        if checkpoint_dir is None:
            return
        directory = Path(checkpoint_dir)
        newer = []
        for existing in ckpt.list_checkpoints(directory):
            try:
                other = ckpt.read_state(existing).get("run_id")
            except Exception:
                other = None
            if other != self.run_id:
                raise CheckpointDirError(
                    f"{directory} already holds checkpoints of another run ({existing.name}); nothing was "
                    "overwritten. Resume it with resume_from_checkpoint=..., or choose an empty checkpoint_dir."
                )
            if ckpt.checkpoint_number(existing) > self.state.checkpoint:
                newer.append(existing)
        if newer:
            # Resuming from an older checkpoint of this run: the newer ones belong to the abandoned
            # continuation. Left in place, they would be taken as "latest" after a crash and pruned
            # in the wrong order; training redoes them (identically, the run being deterministic).
            logger.warning("comlrl: resuming from checkpoint-%d; removing the newer %s of the same run",
                           self.state.checkpoint, ", ".join(p.name for p in newer))
            ckpt.remove_checkpoints(newer)
        if directory.is_dir():  # leftovers of a save or prune that was interrupted: never valid checkpoints
            for stale in list(directory.glob(".tmp-checkpoint-*")) + list(directory.glob(".old-checkpoint-*")):
                shutil.rmtree(stale, ignore_errors=True)

    def _fingerprints(self) -> dict[str, Any]:
        """What a resumed run must share with this one. Nothing in it changes while training (the
        config is frozen, weights are not fingerprinted), so it is computed once: hashing a large
        tokenizer or a dataset at every save would cost more than the save."""
        if self._fingerprint_cache is None:
            self._fingerprint_cache = self._compute_fingerprints()
        return self._fingerprint_cache

    def _compute_fingerprints(self) -> dict[str, Any]:
        # Agents usually share one tokenizer object: hash it once (a 150k vocabulary takes ~0.2 s).
        tokenizers = {id(t): tokenizer_fingerprint(t) for t in {id(t): t for t in self.tokenizers}.values()}
        return {
            "config": {k: v for k, v in self.args.to_dict().items() if k not in RESUMABLE_FIELDS},
            "num_agents": self.num_agents,
            "models": [model_fingerprint(m) for m in self.agents],
            **({"lora_bases": [base_fingerprint(m.shared) for m in self.agents],
                "lora_adapters": [m.fingerprint()["adapter_config"] for m in self.agents]}
               if any(isinstance(m, AdapterAgent) for m in self.agents) else {}),
            "tokenizers": [tokenizers[id(t)] for t in self.tokenizers],
            "dataset": dataset_fingerprint(self.train_rows),
            "reward_func": callable_fingerprint(self.reward.func),
            "reward_processor": callable_fingerprint(self.reward.processor),
            "formatters": [callable_fingerprint(f) for f in self.formatters],
            "external_transition": callable_fingerprint(self.transition.func if self.transition else None),
            **({"references": [base_fingerprint(r if r is not None else m.shared)
                               for r, m in zip(self.references, self.agents)]}
               if self.args.reference_kl_coef else {}),
        }

    def _save(self, checkpoint_dir, limit: Optional[int]) -> Path:
        timer = PhaseTimer(self.device)
        with timer("checkpoint"):
            number = self.state.checkpoint + 1
            self.state.checkpoint = number
            record = {
                "run_id": self.run_id,
                **{k: v for k, v in asdict(self.state).items()},
                "num_train_epochs": self.args.num_train_epochs,
                "done_indices": self._epoch_micro_batches(self.state.epoch)[: self.state.step_in_epoch],
                "wandb": self.wandb_identity,
                "config": self.args.to_dict(),
                "fingerprints": self._fingerprints(),
                "comlrl_version": _version(),
            }
            rng_states = dist.gather_objects(ckpt.capture_rng_state(), self.dist)  # every rank's

            def submit() -> Path:  # once, by rank 0; the weights are the same on every rank
                self._wait_for_save()  # checkpoints commit in order; an earlier failure surfaces here
                # The previous snapshot is written now: its buffers take this one's copies.
                snapshot = ckpt.snapshot_checkpoint(number, self.agents, self.optimizers, self.schedulers, record,
                                                    rng_states, reuse=self._last_snapshot)
                self._last_snapshot = snapshot if snapshot.nbytes() <= REUSE_SNAPSHOT_BYTES else None
                if self._checkpoint_writer is None:
                    self._checkpoint_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comlrl-checkpoint")
                self._pending_save = self._checkpoint_writer.submit(self._write_checkpoint, checkpoint_dir, number,
                                                                    snapshot, limit)
                return ckpt.checkpoint_path(checkpoint_dir, number)

            path = dist.main_process_first_result(submit, self.dist)
        # The save's cost (copying the state; the files are written in the background) shows up in
        # the next logged row.
        self.state.log_window["timing/checkpoint"] = self.state.log_window.get("timing/checkpoint", 0.0) \
            + timer.seconds["checkpoint"]
        self.state.log_window_counts.setdefault("timing/checkpoint", 1)
        return path

    def _write_checkpoint(self, checkpoint_dir, number: int, snapshot: ckpt.Snapshot, limit: Optional[int]) -> Path:
        """The slow half of a save, on the writer thread: files, fsync, rename, pruning."""
        path = ckpt.write_checkpoint(checkpoint_dir, number, snapshot)
        if limit is not None:
            ckpt.prune_checkpoints(checkpoint_dir, limit)
        logger.info("comlrl: saved %s (env_step %s)", path, snapshot.record.get("env_step"))
        return path

    def _drain_save(self) -> None:
        """Never leave train() with a write running; when train() is already failing, the write's
        own error (if any) is logged rather than raised over the original one."""
        try:
            self._wait_for_save()
        except Exception:
            logger.exception("comlrl: writing the last checkpoint failed")

    def _wait_for_save(self) -> None:
        """Block until the checkpoint being written (if any) is committed; raise its error."""
        pending = self._pending_save
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if pending.done():  # interrupted while waiting (Ctrl-C): still pending, still drained later
                self._pending_save = None

    def _resume(self, path: Path) -> Path:
        saved = ckpt.read_state(path)
        fingerprints = dict(saved.get("fingerprints", {}))
        if isinstance(fingerprints.get("config"), dict):
            # A setting added after the checkpoint was written counts as what the code did before it
            # existed: its default, or for rollout_backend the transformers loop ("hf").
            defaults = {f.name: LEGACY_SETTINGS.get(f.name, f.default if f.default is not dataclasses.MISSING
                                                     else f.default_factory())  # type: ignore[misc]
                        for f in dataclasses.fields(self.args) if f.name not in RESUMABLE_FIELDS}
            fingerprints["config"] = {**{k: v for k, v in defaults.items() if k not in fingerprints["config"]},
                                      **fingerprints["config"]}
        differences = compare_fingerprints(fingerprints, self._fingerprints())
        if differences:
            raise ResumeMismatchError(str(path), differences)
        loaded = ckpt.load_checkpoint(path, self.agents, self.optimizers, self.schedulers, rank=self.dist.rank)
        self.rollout_engine.mark_stale()
        saved_world = int(loaded.get("world_size", 1))
        if saved_world != self.dist.world_size and self.dist.is_main:
            logger.warning(
                "comlrl: %s was written by %d process(es) and resumes on %d. Allowed: the global batch, the "
                "samples and the rewards are the same, but gradients are summed in another order, so the run "
                "continues within float tolerance of the uninterrupted one, not bit for bit (same count: exact).%s",
                path, saved_world, self.dist.world_size,
                " Ranks the checkpoint has no random state for start from rank 0's." if self.dist.world_size >
                saved_world else "")
        self.run_id = loaded["run_id"]
        fields = {f for f in TrainState.__dataclass_fields__}
        self.state = TrainState(**{k: loaded[k] for k in fields})
        self.wandb_identity = loaded.get("wandb")
        logger.info("comlrl: resumed %s at epoch %d, env_step %d", path, self.state.epoch, self.state.env_step)
        return path


class MAREINFORCETrainer(MAGRPOTrainer):
    """MAGRPO without a baseline (advantage = return)."""

    config_class, advantage_mode = MAREINFORCEConfig, "raw"


class MARLOOTrainer(MAGRPOTrainer):
    """MAGRPO with the leave-one-out baseline."""

    config_class, advantage_mode = MARLOOConfig, "rloo"


class MAReMaxTrainer(MAGRPOTrainer):
    """MAGRPO with the group-max baseline."""

    config_class, advantage_mode = MAReMaxConfig, "max"


def _can_fuse(params: list[torch.nn.Parameter]) -> Optional[bool]:
    """AdamW's fused kernel (one pass over each tensor instead of a dozen) where torch has it:
    floating-point parameters on CPU or CUDA. It is part of the optimizer state, so a resumed run
    keeps the implementation its checkpoint was written with."""
    ok = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return True if ok else None


def _version() -> str:
    from ... import __version__

    return __version__


def _progress(total: int, initial: int, disable: bool = False):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="MAGRPO", unit="step", dynamic_ncols=True,
                disable=disable or os.environ.get("COMLRL_DISABLE_PROGRESS") == "1")
