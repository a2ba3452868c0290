"""The extension surface (comlrl.extend, docs/extending.md): two trainers written against it only,
the way a user would write one, get exact resume, checkpoints with their own modules, and logging
from the engine."""

import inspect
import math

import pytest
import torch

import comlrl.extend as extend
from comlrl.extend import (AgentRows, MAGRPOConfig, MAGRPOTrainer, PlayedBuffer, Slots, Trainer, TrainerConfig,
                           check_float, concat_rollouts, config_class, discounted_returns, policy_backward,
                           record_turns, select_rows, setting, step_denominator)

from helpers import SEED_PROMPTS, TEST_SETTINGS, assert_bit_exact, length_ratio_reward, rows, state_of


def test_the_surface_is_public_and_documented():
    for name in extend.__all__:
        assert not name.startswith("_") and hasattr(extend, name), name
        value = getattr(extend, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    for hook in ("collect", "optimizer_step", "update_passes", "trained_slots", "step_modules", "play_episodes",
                 "reference_log_probs", "algorithm_state", "load_algorithm_state", "fingerprint_extra", "autocast"):
        assert (getattr(Trainer, hook).__doc__ or "").strip(), hook


# --- a family on the base class: REINFORCE with a learned per-prompt baseline ---------------------------

@config_class
class LearnedBaselineConfig(TrainerConfig):
    """REINFORCE whose baseline is a learned value per prompt (a trained module of its own)."""

    baseline_learning_rate: float = setting(0.1, "Adam learning rate of the per-prompt baseline.",
                                            check_float(lambda v: v > 0, "> 0"))


class LearnedBaselineTrainer(Trainer):
    """Each agent's advantage is its return minus a learned estimate of the prompt's mean return
    (one scalar per dataset row, trained by squared error on the same batch)."""

    config_class = LearnedBaselineConfig
    algorithm_name = "LearnedBaseline"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.baseline = torch.nn.Embedding(len(self.train_dataset), 1)
        torch.nn.init.zeros_(self.baseline.weight)
        self.baseline_optimizer = torch.optim.Adam(self.baseline.parameters(), lr=self.args.baseline_learning_rate)
        self.baseline_scheduler = torch.optim.lr_scheduler.LambdaLR(self.baseline_optimizer, lambda step: 1.0)

    def trained_slots(self) -> Slots:
        slots = super().trained_slots()
        return Slots({**slots.modules, "baseline-0": self.baseline},
                     {**slots.optimizers, "baseline-0": self.baseline_optimizer},
                     {**slots.schedulers, "baseline-0": self.baseline_scheduler})

    def collect(self, mine, epoch, timer):
        if not mine:
            return PlayedBuffer([], {}, {})
        turns = self.play_episodes(mine, epoch, timer)
        with timer("advantage"):
            joint = discounted_returns([t.rewards for t in turns], [t.children for t in turns],
                                       self.args.num_generations, self.args.discount, self.args.num_turns)
        return PlayedBuffer(turns, record_turns(turns, joint), {"returns": joint[0]})

    def optimizer_step(self, buffer, groups):
        k = self.args.num_generations
        turn = buffer.turns[0]
        nodes = [i for i, node in enumerate(turn.nodes) if node.group in groups]
        keep = torch.tensor([i * k + j for i in nodes for j in range(k)], dtype=torch.long)
        prompt_ids = torch.tensor([turn.nodes[i].index for i in nodes]).repeat_interleave(k)
        returns = buffer.data["returns"][keep]
        baseline = self.baseline(prompt_ids).squeeze(1)
        ((baseline - returns.float()) ** 2).mean().backward()
        fixed = baseline.detach().double()
        ids = torch.arange(len(nodes)).repeat_interleave(k)
        for a, model in enumerate(self.agents):
            agent_rows = AgentRows(concat_rollouts([select_rows(turn.rollouts[a], keep)], 0), returns, ids)
            policy_backward(model, agent_rows, lambda r, g: (r - fixed).float(), temperature=self.args.temperature,
                            loss_type="sequence", max_new_tokens=self.args.max_new_tokens,
                            denominator=step_denominator(agent_rows, "sequence", self.args.max_new_tokens, self.dist),
                            micro_groups=None, autocast=self.autocast)
        slots = self.trained_slots()
        metrics, norms = self.step_modules(list(slots.modules.values()), list(slots.optimizers.values()),
                                           list(slots.schedulers.values()))
        metrics["baseline/mean"] = float(fixed.mean())
        return metrics


def _baseline_trainer(model_path, tokenizer, tmp_path, epochs):
    return LearnedBaselineTrainer(
        agent_model=str(model_path), num_agents=2, tokenizer=tokenizer, reward_func=length_ratio_reward,
        train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=LearnedBaselineConfig(**{**{k: v for k, v in TEST_SETTINGS.items() if k != "loss_type"},
                                      "num_train_epochs": epochs, "max_new_tokens": 10, "agent_learning_rate": 1e-3,
                                      "output_dir": str(tmp_path / "out")}))


def test_a_family_with_its_own_trained_module_resumes_exactly(model_path, tokenizer, tmp_path):
    full = _baseline_trainer(model_path, tokenizer, tmp_path / "a", epochs=3)
    full.train(checkpoint_dir=tmp_path / "full")
    assert float(full.baseline.weight.detach().abs().sum()) > 0  # the baseline learned
    assert (tmp_path / "full" / "checkpoint-3" / "baseline-0" / "model.safetensors").is_file()
    assert "baseline/mean" in rows(tmp_path / "full")[-1]
    part = _baseline_trainer(model_path, tokenizer, tmp_path / "b", epochs=1)
    part.train(checkpoint_dir=tmp_path / "part")
    resumed = _baseline_trainer(model_path, tokenizer, tmp_path / "b", epochs=3)
    resumed.train(resume_from_checkpoint=tmp_path / "part" / "checkpoint-1", checkpoint_dir=tmp_path / "part")
    assert_bit_exact(state_of(full), state_of(resumed))
    assert rows(tmp_path / "full") == rows(tmp_path / "part")


def test_a_changed_extra_setting_is_refused_on_resume(model_path, tokenizer, tmp_path):
    _baseline_trainer(model_path, tokenizer, tmp_path, epochs=1).train(checkpoint_dir=tmp_path / "run")
    other = _baseline_trainer(model_path, tokenizer, tmp_path, epochs=2)
    other.args.baseline_learning_rate = 0.5
    from comlrl import ResumeMismatchError

    with pytest.raises(ResumeMismatchError, match="baseline_learning_rate"):
        other.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-1", checkpoint_dir=tmp_path / "run")


# --- a variant of a family: RAFT-style best-of-K on MAGRPO ------------------------------------------

class BestOfKTrainer(MAGRPOTrainer):
    """Rejection-sampling fine-tuning (RAFT, Dong et al. 2023): each group's best joint action is
    imitated (advantage 1), the others ignored (0). Only the advantage hook changes."""

    algorithm_name = "BestOfK"

    def advantages(self, returns, groups):
        best = torch.full((int(groups.max()) + 1,), -math.inf, dtype=returns.dtype).scatter_reduce(
            0, groups, returns, reduce="amax")
        return (returns == best[groups]).to(torch.float32)


def test_a_variant_overrides_one_hook(model_path, tokenizer, tmp_path):
    settings = {**TEST_SETTINGS, "num_train_epochs": 1, "max_new_tokens": 10, "agent_learning_rate": 1e-3,
                "output_dir": str(tmp_path / "out")}
    trainers = [cls(agent_model=str(model_path), num_agents=2, tokenizer=tokenizer, reward_func=length_ratio_reward,
                    train_dataset=[{"prompt": p} for p in SEED_PROMPTS], args=MAGRPOConfig(**settings))
                for cls in (MAGRPOTrainer, BestOfKTrainer)]
    for trainer in trainers:
        trainer.train()
    first, second = (state_of(t) for t in trainers)
    assert any(not torch.equal(first[k], second[k]) for k in first if ".param." in k)  # another algorithm
    adv = trainers[1].advantages(torch.tensor([0.1, 0.7, 0.7, 0.2], dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    assert adv.tolist() == [0.0, 1.0, 1.0, 0.0]
