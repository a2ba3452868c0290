"""The update phase, shared by the trainer families: an agent's rows gathered from the episode
tree, its policy loss back-propagated in micro-batches that add up to the loss of the whole
optimizer step (on every process together), and the optimizer step itself, refused when any
gradient is not finite.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..exceptions import TrainingError
from ..functional.logprobs import sequence_log_probs
from ..functional.losses import PolicyLossSpec, loss_denominator, sequence_kl
from ..rollout import Rollout
from . import distributed as dist

__all__ = ["AgentRows", "concat_rollouts", "select_rows", "policy_backward", "step_denominator", "apply_gradients",
           "StepLoss", "rows_log_probs", "OLD_LOG_PROBS", "ADVANTAGE_WEIGHTS", "collective_passes", "idle_passes",
           "allocate_adam_state", "own_parameters"]

# Keys of AgentRows.extras that policy_backward reads:
OLD_LOG_PROBS = "old_log_probs"          # [R, T] the sampling policy's log-probs: the clipped-ratio (PPO) loss
ADVANTAGE_WEIGHTS = "advantage_weights"  # [R] a factor on each row's advantage (HAPPO's product of ratios)


def select_rows(ro: Rollout, rows: torch.Tensor) -> Rollout:
    """The rows ``rows`` (int64 ``[R']``) of a rollout."""
    idx = rows.to(ro.prompt_ids.device)
    return Rollout(ro.prompt_ids[idx], ro.prompt_mask[idx], ro.completion_ids[idx], ro.completion_mask[idx],
                   ro.group_ids[idx], [ro.texts[int(i)] for i in rows.tolist()])


def concat_rollouts(parts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """Rows of several rollouts in one batch: prompts re-left-padded, completions re-right-padded
    to the widest (padding is masked out, so every row's log-probs are unchanged)."""
    if len(parts) == 1:
        return parts[0]
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_c = max(p.completion_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, width: int, left: bool, value: int) -> torch.Tensor:
        extra = width - t.shape[1]
        if extra == 0:
            return t
        filler = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
        return torch.cat([filler, t] if left else [t, filler], dim=1)

    return Rollout(torch.cat([pad(p.prompt_ids, width_p, True, pad_token_id) for p in parts]),
                   torch.cat([pad(p.prompt_mask, width_p, True, 0) for p in parts]),
                   torch.cat([pad(p.completion_ids, width_c, False, pad_token_id) for p in parts]),
                   torch.cat([pad(p.completion_mask, width_c, False, 0) for p in parts]),
                   torch.cat([p.group_ids for p in parts]), [t for p in parts for t in p.texts])


@dataclass
class AgentRows:
    """One agent's completions for the nodes of one optimizer step, and what its loss needs."""

    rollout: Rollout        # [R] rows, node-major, K rows per node
    returns: torch.Tensor   # [R] float64 return of each completion
    groups: torch.Tensor    # [R] int64 node of each row, 0 .. nodes-1
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # more [R, ...] per-row values (a family's)

    @property
    def num_groups(self) -> int:
        return int(self.groups.max()) + 1 if len(self.groups) else 0

    def micro_batches(self, max_groups: Optional[int]) -> list["AgentRows"]:
        """Pieces of at most ``max_groups`` whole nodes (a node's K rows stay together: its
        advantages compare them)."""
        count = self.num_groups
        if max_groups is None or count <= max_groups:
            return [self]
        out = []
        for start in range(0, count, max_groups):
            keep = ((self.groups >= start) & (self.groups < start + max_groups)).nonzero().squeeze(1)
            out.append(AgentRows(select_rows(self.rollout, keep), self.returns[keep], self.groups[keep] - start,
                                 {k: v[keep.to(v.device)] for k, v in self.extras.items()}))
        return out


@dataclass
class StepLoss:
    """What one agent's backward reports: its loss on this process's rows (already divided by the
    step's global denominator, so processes' values add up) and the mean KL of its rows."""

    loss: float = 0.0
    kl_sum: float = 0.0
    rows: int = 0
    clipped: float = 0.0                   # scored tokens the clip held back (clipped-ratio loss)
    tokens: float = 0.0                    # scored tokens
    log_probs: Optional[torch.Tensor] = None  # [R, T] the rows' log-probs, detached (keep_log_probs=True)


AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (returns [R], groups [R]) -> [R]


def policy_backward(model: torch.nn.Module, rows: AgentRows, advantages: AdvantageFn, *, temperature: float,
                    denominator: float, micro_groups: Optional[int], loss: Optional[PolicyLossSpec] = None,
                    reference: Optional[Callable[[Rollout], torch.Tensor]] = None, kl_coef: float = 0.0,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                    keep_log_probs: bool = False, passes: Optional[int] = None, loss_type: Optional[str] = None,
                    max_new_tokens: Optional[int] = None, clip_eps: Optional[float] = None,
                    ratio_loss: bool = False) -> StepLoss:
    """Back-propagate an agent's policy loss over ``rows``, micro-batch by micro-batch.

    Per micro-batch: one padded forward for the rows' log-probs; with a ``reference`` (a function
    giving the reference policy's log-probs of the same rows) each completion's return is reduced
    by ``kl_coef`` times its KL to the reference (the log-ratio estimate: see
    :func:`comlrl.functional.losses.sequence_kl`; no gradient through it); the
    advantages (times ``rows.extras[ADVANTAGE_WEIGHTS]`` when given); the ``loss`` divided by
    ``denominator``, that of the whole optimizer step on all processes; backward.

    ``loss``: a :class:`~comlrl.functional.losses.PolicyLossSpec` naming a registered policy loss
    (build it once per run). A loss registered with ``ratio=True`` (``"clipped"``: PPO's clipped
    ratio) compares against ``rows.extras[OLD_LOG_PROBS]``, the sampling policy's log-probs
    (absent: the policy has not changed since sampling, so this very forward's log-probs are the
    old ones and every ratio is 1); the KL penalty is then taken from the old log-probs, so that
    advantages stay those of the samples however many updates reuse them. Without ``loss`` the
    spec is built from ``loss_type``, ``max_new_tokens``, ``clip_eps`` and ``ratio_loss``
    (``"clipped"`` when True, else ``"reinforce"``), as before registries.

    ``passes`` (sharded agents, see :func:`collective_passes`): run idle passes after this
    process's micro-batches until every process has run that many.
    """
    if loss is None:
        loss = PolicyLossSpec("clipped" if ratio_loss else "reinforce", loss_type or "sequence", max_new_tokens,
                              clip_eps)
    ratio = loss.uses_old_log_probs
    out = StepLoss()
    kept: list[torch.Tensor] = []
    # Eval mode, as during sampling: the gradient must be that of the policy that sampled
    # (dropout would make it another policy's, biasing the ratio-1 on-policy loss).
    model.eval()
    pieces = rows.micro_batches(micro_groups)
    for piece in pieces:
        ro = piece.rollout
        with autocast():
            logp = sequence_log_probs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, temperature)
        old = piece.extras.get(OLD_LOG_PROBS) if ratio else None
        old = old.to(logp.device) if old is not None else (logp.detach() if ratio else None)
        returns = piece.returns
        if reference is not None:
            kl = sequence_kl(old if old is not None else logp, reference(ro), ro.completion_mask).cpu()
            returns = returns - kl_coef * kl
            out.kl_sum += float(kl.sum())
        adv = advantages(returns, piece.groups)
        if ADVANTAGE_WEIGHTS in piece.extras:
            adv = adv * piece.extras[ADVANTAGE_WEIGHTS].to(adv.dtype)
        value, clipped = loss(logp, old, adv.to(logp.device), ro.completion_mask, denominator)
        if clipped is not None:
            out.clipped += float(clipped.sum())
        value.backward()
        out.loss += float(value.detach())
        out.rows += len(piece.returns)
        out.tokens += float(ro.completion_mask.sum())
        if keep_log_probs:
            kept.append(logp.detach())
    if keep_log_probs and kept:
        out.log_probs = torch.cat(kept)
    idle_passes(model, (passes or 0) - len(pieces), reference=reference, grad=True, autocast=autocast)
    return out


@torch.no_grad()
def rows_log_probs(model: torch.nn.Module, rows: AgentRows, *, temperature: float, micro_groups: Optional[int],
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   passes: Optional[int] = None) -> torch.Tensor:
    """``[R, T]`` log-probs of ``rows``' sampled tokens under ``model`` now, in the micro-batches
    :func:`policy_backward` uses (so that the values equal those of its forward bit for bit);
    ``passes`` as in :func:`policy_backward`."""
    model.eval()
    parts = []
    for piece in rows.micro_batches(micro_groups):
        ro = piece.rollout
        with autocast():
            parts.append(sequence_log_probs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, temperature))
    idle_passes(model, (passes or 0) - len(parts), grad=False, autocast=autocast)
    return torch.cat(parts)


def collective_passes(rows: Optional[AgentRows], micro_groups: Optional[int], ctx: dist.DistContext,
                      sharded: bool) -> Optional[int]:
    """For a sharded agent (every forward and backward a collective), the number of micro-batch
    passes every process runs: the most any process has (None when the agent is not sharded)."""
    if not sharded:
        return None
    local = len(rows.micro_batches(micro_groups)) if rows is not None else 0
    return int(dist.all_reduce_max([local], ctx)[0])


def idle_passes(model: torch.nn.Module, count: int, *, reference: Optional[Callable[[Rollout], torch.Tensor]] = None,
                grad: bool, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """``count`` forward (and with ``grad``, backward) passes of one token that add nothing to any
    gradient: a process with fewer rows than the others takes part in every collective of a
    sharded model (the reference's forward too, when the real passes run one)."""
    if count <= 0:
        return
    device = next(model.parameters()).device
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    idle = Rollout(one, torch.ones_like(one), one.clone(), torch.ones((1, 1), dtype=torch.bool, device=device),
                   torch.zeros(1, dtype=torch.long, device=device), [""])
    for _ in range(count):
        with torch.set_grad_enabled(grad), autocast():
            logp = sequence_log_probs(model, idle.prompt_ids, idle.prompt_mask, idle.completion_ids, 1.0)
        if reference is not None:
            reference(idle)
        if grad:
            (logp.sum() * 0.0).backward()


def step_denominator(rows: Optional[AgentRows], loss_type: str, max_new_tokens: int, ctx: dist.DistContext) -> float:
    """The loss denominator of an optimizer step over every process's rows (see
    :func:`comlrl.functional.losses.loss_denominator`); ``rows`` None: this process has none."""
    local = loss_denominator(rows.rollout.completion_mask, loss_type, max_new_tokens) if rows is not None else 0.0
    return dist.all_reduce_sum([local], ctx)[0]


@torch.no_grad()
def own_parameters(params: Sequence[torch.nn.Parameter]) -> None:
    """Give trained parameters memory of their own. ``from_pretrained`` maps a safetensors file's
    pages into the process and the tensors use them in place; the first optimizer step then writes
    into those pages one copy-on-write fault at a time (5.8 s for a 0.5B agent on our CPU machines,
    against 0.5 s for one bulk copy here). Sharded (DTensor) parameters are their own already."""
    for p in params:
        if not hasattr(p, "to_local"):
            p.data = p.data.clone()


def allocate_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an Adam / AdamW's per-parameter state now, exactly as its first step would (zero
    moments, a zero step count): the memory is claimed, and first touched, when the trainer is
    built rather than inside the first timed optimizer step (for a 0.5B agent that first touch
    took 10-15 s on our CPU machines). Parameters that never get a gradient keep zeros."""
    from torch.optim import optimizer as torch_optimizer

    scalar = getattr(torch_optimizer, "_get_scalar_dtype", None)
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        dtype = (scalar(is_fused=group.get("fused")) if on_device else scalar()) if scalar else torch.float32
        for p in group["params"]:
            state = optimizer.state[p]
            if state or not p.requires_grad:
                continue
            state["step"] = torch.zeros((), dtype=dtype, device=p.device) if on_device else \
                torch.tensor(0.0, dtype=dtype, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sum_gradients(model: torch.nn.Module, ctx: dist.DistContext) -> None:
    """The sum over processes of every gradient of ``model``: all-reduced here, or for a sharded
    model already reduced by FSDP as an average (each process's shard), turned back into the sum.
    (FSDP's ``set_gradient_divide_factor(1.0)`` would sum directly, but it reduces with
    ``ReduceOp.PREMUL_SUM``, which gloo does not support.)"""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not sharded:
        dist.all_reduce_gradients(list(model.parameters()), ctx)
        return
    if ctx.world_size > 1:
        for p in sharded:
            if p.grad is not None:
                p.grad.mul_(ctx.world_size)


def _total_norm(grads: Sequence[torch.Tensor]) -> float:
    """L2 norm of every gradient together (of the whole tensors, for shards)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(list(grads))
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def apply_gradients(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                    schedulers: Sequence, max_grad_norm: Optional[float], ctx: dist.DistContext,
                    nonfinite: str, where: str, names: Optional[Sequence[str]] = None,
                    applied: Sequence[str] = ()) -> Optional[list[float]]:
    """Sum gradients over processes, check them, then clip, step and zero every model.

    ``names`` name the models in an error (default ``model i``); ``applied`` names what the same
    optimizer step already updated before these models (said in the error).

    Returns the pre-clip gradient norms, or None if the step was skipped (``nonfinite="skip"``
    and some gradient was not finite: every gradient is discarded, no weight changes).

    Raises:
        TrainingError: a gradient is not finite and ``nonfinite="raise"``; none of ``models`` was updated.
    """
    norms = []
    for model in models:
        _sum_gradients(model, ctx)
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(_total_norm([p.grad for p in params]) if params else 0.0)
    bad = [i for i, n in enumerate(norms) if not math.isfinite(n)]
    if bad:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if nonfinite == "skip":
            return None
        name = names[bad[0]] if names else f"model {bad[0]}"
        done = (f" (this step had already updated {', '.join(applied)}: resume from the last checkpoint to redo it "
                "whole)") if applied else ""
        raise TrainingError(f"{where}: the gradient of {name} is not finite (norm {norms[bad[0]]}); it was not "
                            f"applied and nothing non-finite was saved{done}. Lower the learning rate or check the "
                            "rewards, or set nonfinite='skip' to drop such updates.")
    for model, opt, sched, norm in zip(models, optimizers, schedulers, norms):
        params = [p for p in model.parameters() if p.grad is not None]
        if max_grad_norm is not None and params:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, torch.tensor(norm))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return norms
