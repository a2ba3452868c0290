"""MARLHF: multi-agent RLHF, on the shared engine.

    pairs      as MADPO: candidates per prompt, scored by the task reward, pairs kept
    reward     a joint reward model (a causal-LM backbone and a scalar head on the last real
               token) trained on the pairs with the Bradley-Terry loss, winners and losers of a
               batch in one padded forward
    rl         the reward model, frozen, is the reward of an online phase run by the trainer
               ``rl_algorithm`` names (MAGRPO and its variants, or IAC / MAAC) on the same agents,
               for num_train_epochs epochs; evaluation keeps the task reward

Checkpoints are saved after the pairs, after the reward model's training and as the online phase's
(every epoch, save_steps); the reward model and its optimizer are in every one.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ...engine import distributed as dist
from ...engine.schedule import TrainingLoop
from ...engine.streams import Stream, stream_rng
from ...engine.timing import PhaseTimer
from ...exceptions import ConfigError
from ...functional.logprobs import plain_head
from ...functional.preference import bradley_terry_loss
from ...models.actor_critic import unwrap_policy
from ...rollout import left_pad
from ..actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer  # noqa: F401  (looked up at call time)
from ..reinforce import MAGRPOConfig, MAGRPOTrainer
from .config import MAGRPO_FAMILY, MARLHFConfig
from .madpo import MADPOTrainer
from .pairs import PreferencePair

__all__ = ["JointRewardModel", "MARLHFConfig", "MARLHFTrainer", "joint_reward_text"]

logger = logging.getLogger("comlrl")


class JointRewardModel(torch.nn.Module):
    """A scalar reward of a joint answer: a causal-LM ``backbone`` and ``reward_head`` (a linear
    layer) on the final hidden state of the last real token of each row (left or right padding).

    Args:
        backbone: a transformers causal LM (its LM head is not used).
        freeze_backbone: train only the head.
    """

    def __init__(self, backbone: torch.nn.Module, freeze_backbone: bool = False):
        super().__init__()
        config = getattr(backbone, "config", None)
        size = None
        for key in ("hidden_size", "n_embd", "d_model"):
            size = size or getattr(config, key, None)
        if not isinstance(size, int):
            raise ConfigError(f"Could not infer reward model hidden size: {type(backbone).__name__}'s config has no "
                              "hidden_size, n_embd or d_model.")
        self.backbone = backbone
        first = next(iter(backbone.parameters()), None)
        self.reward_head = torch.nn.Linear(size, 1)
        if first is not None:
            self.reward_head.to(device=first.device, dtype=first.dtype if first.is_floating_point() else None)
        if freeze_backbone:
            backbone.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` rewards of ``[B, L]`` token rows."""
        plain = plain_head(self.backbone)
        if plain is not None:  # hidden states without the language-model head
            positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            hidden = plain[0](input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                              use_cache=False)[0]
        else:
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                   use_cache=False).hidden_states[-1]
        width = attention_mask.shape[1]
        last = (attention_mask.bool() * torch.arange(width, device=attention_mask.device)).amax(dim=1)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.reward_head(hidden[rows, last.to(hidden.device)].to(self.reward_head.weight.dtype)).squeeze(-1)

    def checkpoint_parts(self) -> dict[str, torch.nn.Module]:
        """How a checkpoint stores it: the backbone as a model folder, ``reward_head.safetensors`` beside it."""
        return {"backbone": self.backbone, "reward_head": self.reward_head}


def joint_reward_text(prompts: Sequence[str], completions: Sequence[str]) -> str:
    """What the reward model reads of a joint answer (CoMLRL's layout, agents numbered from 1)."""
    parts = ["Joint multi-agent response"]
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        parts += [f"Agent {i + 1} prompt:\n{prompt}", f"Agent {i + 1} response:\n{completion}"]
    return "\n\n".join(parts)


class MARLHFTrainer(MADPOTrainer):
    """Multi-agent RLHF for N cooperating causal LMs (or one centralised actor).

    Args: as :class:`MADPOTrainer` with a :class:`MARLHFConfig`, and (keywords):
        metrics_callback: for an actor-critic online phase (``rl_algorithm`` maac / iac).
        critic_model, critics: the critics of that phase (default: ``critic_model_name``, else the
            agents' model).
        reward_model: the reward model's backbone (a name, a causal LM, or a
            :class:`JointRewardModel`); default ``reward_model_name``, else the agents' model name,
            else a copy of the first agent's initial weights.
    """

    config_class = MARLHFConfig
    default_config_cls = MARLHFConfig
    algorithm_name = "MARLHF"
    _phases = ("pairs", "reward", "rl")

    def __init__(self, *args: Any, metrics_callback: Any = None, critic_model: Any = None,
                 critics: Optional[Sequence[Any]] = None, reward_model: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.metrics_callback = metrics_callback
        if metrics_callback is not None and self.centralized_collaboration is not None:
            metrics_callback = self.centralized_collaboration.wrap_metrics_callback(metrics_callback)
        self.reward_device = self._reward_device()
        self.reward_model, self.reward_tokenizer = self._build_reward_model(reward_model)
        (self.reward_optimizer,), (self._reward_scheduler,) = self._optimizers([self.reward_model],
                                                                               lr=self.args.reward_learning_rate)
        self._task_rewards: list[float] = []
        self.rl = self._build_online_trainer(metrics_callback, critic_model, critics)

    # --- construction ---------------------------------------------------------------------------
    def _reward_device(self) -> torch.device:
        spec = self.args.reward_model_device
        if spec is None or (spec == "cuda:0" and not torch.cuda.is_available()):
            return self.agent_devices[0]  # CoMLRL's default 'cuda:0' on a machine without CUDA
        from ...engine.devices import DeviceScheduler, check_available

        return check_available(DeviceScheduler.resolve_devices(spec, 1, kind="reward_model_device")[0],
                               "reward_model_device")

    def _build_reward_model(self, source: Any) -> tuple[JointRewardModel, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ...engine.hub import load_pretrained
        from ...engine.inputs import model_kwargs

        source = source if source is not None else self.args.reward_model_name
        if source is None:
            source = self._resolved.sources[0]  # the name the agents were loaded from, if any
        tokenizer = self.tokenizers[0]
        if isinstance(source, JointRewardModel):
            model = source
        elif isinstance(source, str):
            backbone = load_pretrained(AutoModelForCausalLM, source, "reward model", **model_kwargs(self.model_config))
            tokenizer = load_pretrained(AutoTokenizer, source, "reward model tokenizer")
            model = JointRewardModel(backbone, self.args.reward_freeze_backbone)
        else:
            policy = unwrap_policy(source) if isinstance(source, torch.nn.Module) else self._policies()[0]
            from ...adapters import AdapterAgent

            if isinstance(policy, AdapterAgent):
                raise ConfigError("with LoRA agents the reward model needs its own weights: set reward_model_name (or "
                                  "pass reward_model=...).")
            model = JointRewardModel(copy.deepcopy(policy) if source is None else policy,
                                     self.args.reward_freeze_backbone)
        if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.to(self.reward_device), tokenizer

    def _online_config(self) -> Any:
        """The config of the online phase, from this run's settings."""
        a = self.args
        common = dict(agent_learning_rate=a.agent_learning_rate, num_train_epochs=a.num_train_epochs,
                      num_agents=self.num_agents, num_generations=a.num_generations, num_turns=1,
                      max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                      rollout_buffer_size=a.rollout_buffer_size, train_batch_size=a.train_batch_size,
                      advantage_normalization=a.advantage_normalization, eval_interval=0,
                      logging_steps=a.logging_steps, reference_kl_enabled=a.reference_kl_enabled,
                      reference_kl_coef=a.reference_kl_coef, reference_devices=a.reference_devices,
                      agent_devices=a.agent_devices, parallel_training=a.parallel_training, seed=a.seed,
                      shuffle=a.shuffle, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
                      adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_epsilon=a.adam_epsilon,
                      max_grad_norm=a.max_grad_norm, micro_batch_size=a.micro_batch_size, nonfinite=a.nonfinite,
                      mixed_precision=a.mixed_precision, rollout_backend=a.rollout_backend,
                      output_dir=a.output_dir, early_termination_threshold=None)
        if a.rl_algorithm in MAGRPO_FAMILY:
            return MAGRPOConfig(**common, advantage_mode=MAGRPO_FAMILY[a.rl_algorithm])
        critic = dict(critic_learning_rate=a.critic_learning_rate, critic_type=a.critic_type,
                      value_loss_coef=a.value_loss_coef, critic_devices=a.critic_devices,
                      critic_value_head_hidden_dim=a.critic_value_head_hidden_dim)
        if a.rl_algorithm == "maac":
            return MAACConfig(**common, **critic)
        return IACConfig(**common, **critic, use_separate_critic=a.use_separate_critic,
                         value_clip_range=a.value_clip_range, value_head_hidden_dim=a.value_head_hidden_dim)

    def _build_online_trainer(self, metrics_callback: Any, critic_model: Any, critics: Any) -> Any:
        """The trainer of the online phase, on THIS trainer's agents, state, backend and checkpoints."""
        a = self.args
        inputs = dict(agents=list(self._policies()), tokenizer=list(self.tokenizers), reward_func=self._learned_reward,
                      formatters=[f.source for f in self.formatters], train_dataset=self.train_dataset,
                      args=self._online_config())
        if a.rl_algorithm in MAGRPO_FAMILY:
            inner = MAGRPOTrainer(**inputs)
        else:
            needs_critic = a.rl_algorithm == "maac" or a.use_separate_critic
            if needs_critic and critic_model is None and critics is None:
                critic_model = a.critic_model_name or (self.model_name if self._resolved.sources[0] else None)
                if critic_model is None:
                    raise ConfigError(f"rl_algorithm={a.rl_algorithm!r} needs a critic: set critic_model_name (or "
                                      "pass critic_model=... / critics=[...]).")
            cls = globals()["MAACTrainer" if a.rl_algorithm == "maac" else "IACTrainer"]
            inner = cls(**inputs, metrics_callback=metrics_callback,
                        critic_model=critic_model if needs_critic else None, critics=critics if needs_critic else None)
        inner.backend.close()
        inner.backend, inner.checkpoints, inner.dist, inner.state = self.backend, self.checkpoints, self.dist, self.state
        inner.run_id = self.run_id
        return inner

    # --- the learned reward -----------------------------------------------------------------------
    def _learned_reward(self, *completions: list[str], prompts: Any = None, batch_items: Any = None,
                        **_: Any) -> list[float]:
        """The online phase's reward: the frozen reward model's score of each joint answer (and,
        for the logs, the task reward of the same answers)."""
        item = (batch_items or [{}])[0]
        agent_prompts = [str(f(item)) for f in self.formatters]
        texts = [joint_reward_text(agent_prompts, answer) for answer in zip(*completions)]
        with torch.no_grad():
            scores = self._score(texts)
        task = self.reward(list(completions), agent_prompts[0], item)
        self._task_rewards.extend(float(t) for t in task)
        return [float(s) for s in scores]

    _learned_reward.reward_batched = True  # one reward-model forward for a task item's joint answers

    def _encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded token rows of the reward model (each cut to its last reward_max_length
        tokens, or the backbone's context)."""
        config = getattr(self.reward_model.backbone, "config", None)
        limit = self.args.reward_max_length or getattr(config, "max_position_embeddings", None) or \
            getattr(config, "n_positions", None)
        rows = [self.reward_tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        if limit:
            rows = [r[-limit:] for r in rows]
        return left_pad(rows, self.reward_tokenizer.pad_token_id, self.reward_device)

    def _score(self, texts: Sequence[str]) -> torch.Tensor:
        self.reward_model.eval()
        ids, mask = self._encode(texts)
        return self.reward_model(ids, mask).float()

    def _pair_texts(self, pairs: Sequence[PreferencePair]) -> list[str]:
        """Winners' then losers' joint texts."""
        return ([joint_reward_text(p.prompts, p.winner_completions) for p in pairs]
                + [joint_reward_text(p.prompts, p.loser_completions) for p in pairs])

    def reward_model_accuracy(self, pairs: Sequence[PreferencePair]) -> float:
        """The fraction of ``pairs`` whose winner the reward model scores higher."""
        if not pairs:
            return math.nan
        with torch.no_grad():
            scores = self._score(self._pair_texts(pairs))
        return float((scores[:len(pairs)] > scores[len(pairs):]).double().mean())

    # --- the schedule -----------------------------------------------------------------------------
    def _phase_after_pairs(self) -> str:
        return "reward"

    def is_complete(self) -> bool:
        return self._phase == "rl" and self.state.epoch >= self.args.num_train_epochs

    def _skip_pair_set(self) -> None:
        self._phase, self.state.epoch = "rl", self.args.num_train_epochs

    def _train_pair_set(self, loop: TrainingLoop, progress: Any) -> None:
        """The reward model on the pair set, then num_train_epochs of the online phase."""
        if self._phase == "reward":
            self._train_reward_model(loop)
            self._phase = "rl"
            self.state.epoch, self.state.items_in_epoch = 0, 0
            loop.checkpoint()
        online = self.online_phase()
        while self.state.epoch < self.args.num_train_epochs:
            loop.run_epoch(progress, online)

    def _train_reward_model(self, loop: TrainingLoop) -> None:
        """reward_num_train_epochs of the Bradley-Terry loss over the pair set, reward_train_batch_size
        pairs per step (split over processes), in a seeded order per epoch."""
        pairs, a = self._pair_set.pairs, self.args
        size = a.reward_train_batch_size
        for epoch in range(a.reward_num_train_epochs):
            timer = PhaseTimer(self.device)
            order = stream_rng(a.seed, Stream.REWARD_MODEL_ORDER, self._set_id, epoch).permutation(len(pairs)).tolist()
            losses, correct = [], 0.0
            with timer("reward_model"):
                for start in range(0, len(order), size):
                    batch = order[start:start + size]
                    mine = [pairs[i] for i in dist.shard(batch, self.dist)]
                    loss_sum, right = 0.0, 0.0
                    self.reward_model.train()
                    if mine:
                        ids, mask = self._encode(self._pair_texts(mine))
                        scores = self.reward_model(ids, mask).float()
                        loss = bradley_terry_loss(scores[:len(mine)], scores[len(mine):], float(len(batch)))
                        loss.backward()
                        loss_sum = float(loss.detach())
                        right = float((scores[:len(mine)] > scores[len(mine):]).double().sum())
                    loss_sum, right = dist.all_reduce_sum([loss_sum, right], self.dist)
                    self._settle_checkpoint()
                    from ...engine.step import apply_gradients

                    apply_gradients([self.reward_model], [self.reward_optimizer], [self._reward_scheduler],
                                    a.max_grad_norm, self.dist, a.nonfinite, f"reward-model step {len(losses) + 1}")
                    losses.append(loss_sum)
                    correct += right
            self.reward_model.eval()
            last = {"reward_model/loss": sum(losses) / max(len(losses), 1),
                    "reward_model/accuracy": correct / max(len(pairs), 1)}
            # Reward-model epochs take no environment step: their rows share one env_step, where the
            # window averages them. The last epoch's values are also kept apart.
            loop.log({**last, "reward_model/epoch": float(epoch + 1), **timer.metrics()})
        loop.log({k.replace("reward_model/", "reward_model/final_"): v for k, v in last.items()})  # epochs >= 1

    # --- the online phase: the inner trainer's buffers on this trainer's loop ------------------------
    def total_steps(self) -> Optional[int]:
        return self.rl.total_steps() if self._phase == "rl" else None

    def _check_world(self) -> None:
        super()._check_world()
        try:  # the online phase's optimizer steps too, whatever phase a resume starts in
            self.rl._check_world()
        except ConfigError as error:
            raise ConfigError(f"MARLHF's online phase (rl_algorithm={self.args.rl_algorithm!r}): {error}") from None

    def online_phase(self) -> "OnlinePhase":
        """What the online phase's epochs run on (an :class:`~comlrl.engine.schedule.EpochSchedule`);
        a subclass that changes the online phase's buffers returns its own."""
        return OnlinePhase(self)

    def _reset_pending(self) -> None:
        super()._reset_pending()
        if hasattr(self, "rl"):
            self.rl._reset_pending()
            self.rl.state, self.rl.run_id = self.state, self.run_id  # a resume replaced them

    # --- checkpoints --------------------------------------------------------------------------------
    def trained_slots(self):
        from ...checkpoint.manager import Slots

        own = super().trained_slots()
        inner = self.rl.trained_slots()
        return Slots({**inner.modules, "reward-model-0": self.reward_model},
                     {**inner.optimizers, "reward-model-0": self.reward_optimizer},
                     {**inner.schedulers, "reward-model-0": self._reward_scheduler}, data=own.data)

    def fingerprint_extra(self) -> dict[str, Any]:
        from ...checkpoint.fingerprint import model_fingerprint

        return {**super().fingerprint_extra(), "reward_model": model_fingerprint(self.reward_model),
                "online": self.rl.fingerprint_extra()}

    def _run_config_extra(self) -> dict[str, Any]:
        return {**super()._run_config_extra(), "rl_algorithm": self.args.rl_algorithm}


class OnlinePhase:
    """MARLHF's online phase as the loop sees it (an :class:`~comlrl.engine.schedule.EpochSchedule`):
    the inner trainer's buffers, scored by the frozen reward model, on the MARLHF trainer's loop,
    state and checkpoints. Its rows keep ``train/reward_*`` the TASK's reward (``train/task_reward_mean``
    too); the reward model's scores are ``train/learned_reward_*``."""

    def __init__(self, trainer: MARLHFTrainer):
        self.trainer, self.rl = trainer, trainer.rl

    def epoch_order(self, epoch: int) -> list[int]:
        return self.rl.epoch_order(epoch)

    def buffer_prompts(self) -> int:
        return self.rl.buffer_prompts()

    def eval_due(self, start: int, count: int) -> bool:
        return self.rl.eval_due(start, count)

    def train_buffer(self, indices: list[int], epoch: int, timer: PhaseTimer) -> dict[str, float]:
        trainer = self.trainer
        trainer._task_rewards = []
        metrics = self.rl.train_buffer(indices, epoch, timer)
        metrics = {(k.replace("train/reward_", "train/learned_reward_") if k.startswith("train/reward_") else k): v
                   for k, v in metrics.items()}
        task = [r for part in dist.gather_objects(trainer._task_rewards, trainer.dist) for r in part]  # rank order
        if task:
            metrics["train/task_reward_mean"] = metrics["train/reward_mean"] = float(np.mean(task))
        return metrics
