"""Data parallelism over ``torch.distributed``, as launched by ``torchrun``.

Every process holds every agent. The prompts of each optimizer step are split across processes,
each process rolls out, scores and back-propagates its share, and the agents' gradients are summed
over processes (bucketed all-reduces per agent and optimizer step) before the identical AdamW step
on every process. Weights therefore stay equal on all ranks without ever being sent again.

Why explicit all-reduces once per optimizer step rather than wrapping agents in
``DistributedDataParallel``: DDP synchronises inside ``backward`` and needs every rank to run the
same number of forward/backward passes. Here a step runs one backward per agent, turn and
micro-batch; with multi-turn early termination the number of turns differs between ranks, and the
last micro-batch of an epoch may leave a rank with no prompt at all. Summing once, after all
backward passes, is what DDP with ``no_sync()`` on every pass but the last would do, without that
constraint. The collective itself is ``torch.distributed.all_reduce`` (gloo on CPU, NCCL on GPU).

Single process (no ``WORLD_SIZE`` > 1 in the environment): every function here is a no-op that
returns its input, so the trainer has one code path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..exceptions import ComlrlError, ConfigError

__all__ = ["DistContext", "init_distributed", "shard", "gather_objects", "main_process_first_result",
           "all_reduce_gradients", "all_reduce_sum", "all_reduce_max", "broadcast_parameters"]

logger = logging.getLogger("comlrl")
T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size`` processes, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"WORLD_SIZE > 1 is set but {name}={value!r} is not an int; launch with torchrun "
                          "(which sets RANK, LOCAL_RANK and WORLD_SIZE), or unset WORLD_SIZE.") from None


def init_distributed(backend: str | None = None, use_cuda: bool | None = None, always: bool = False) -> DistContext:
    """Join the process group ``torchrun`` describes in the environment; single process otherwise.

    The backend is NCCL when the agents train on CUDA (``use_cuda``; default: CUDA is available),
    else gloo. An already initialised group (e.g. by the user's own script) is used as it is. With
    CUDA, each process is pinned to ``cuda:LOCAL_RANK``. ``always``: join a group of one process
    too, when torchrun started one (sharded agents need a process group).
    """
    cuda = torch.cuda.is_available() if use_cuda is None else (use_cuda and torch.cuda.is_available())
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        if cuda:
            torch.cuda.set_device(local % torch.cuda.device_count())
        return DistContext(dist.get_rank(), dist.get_world_size(), local)
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if world <= 1 and not (always and "WORLD_SIZE" in os.environ):
        return DistContext()
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed support.")
    rank, local = _env_int("RANK"), _env_int("LOCAL_RANK")
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(backend=backend or ("nccl" if cuda else "gloo"))
    logger.info("comlrl: process %d of %d (local rank %d), backend %s", rank, world, local, dist.get_backend())
    return DistContext(rank, world, local)


def shard(items: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's contiguous share of ``items``; shares differ in size by at most one (the first
    ``len(items) % world_size`` ranks take one more), so concatenating them in rank order gives
    ``items`` back."""
    base, extra = divmod(len(items), ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    return list(items[start:start + base + (1 if ctx.rank < extra else 0)])


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _all_reduce(values: Sequence[float], ctx: DistContext, op: Any) -> list[float]:
    if not ctx.enabled:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=op)
    return tensor.cpu().tolist()


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of a few float64 numbers over ranks (exact for counts)."""
    return _all_reduce(values, ctx, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Element-wise maximum of a few numbers over ranks."""
    return _all_reduce(values, ctx, dist.ReduceOp.MAX)


def main_process_first_result(fn: Callable[[], T], ctx: DistContext) -> T:
    """Run ``fn`` on rank 0 only and hand its result (or its exception) to every rank.

    For work that must happen once (removing stale checkpoints, writing a file) but whose failure
    every rank must see: the others raise the same exception instead of waiting forever.
    """
    if not ctx.enabled:
        return fn()
    payload: list[Any] = [None]
    if ctx.is_main:
        try:
            payload[0] = ("ok", fn())
        except Exception as exc:  # handed to every rank, then raised here too
            payload[0] = ("error", exc)
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        if ctx.is_main:
            raise value
        raise value if isinstance(value, ComlrlError) else ComlrlError(f"rank 0 failed: {value!r}")
    return value


def broadcast_parameters(modules: Iterable[torch.nn.Module], ctx: DistContext) -> None:
    """Copy rank 0's parameters and buffers to every rank (DDP does the same when it wraps)."""
    if not ctx.enabled:
        return
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


BUCKET_BYTES = 64 * 2**20  # gradients are summed in buckets of about this size (DDP's default is 25 MB)


def all_reduce_gradients(parameters: Sequence[torch.nn.Parameter], ctx: DistContext) -> None:
    """Sum the gradients of ``parameters`` over ranks, in place, in flat buckets of ``BUCKET_BYTES``.

    A parameter that has a gradient on some rank but not here (this rank had no prompt) takes
    part with zeros and receives the sum, so every rank steps the same. One that has no gradient
    on any rank keeps ``grad=None``, as in a single process (AdamW then leaves it alone). Extra
    memory: one bucket, not a second copy of all gradients.
    """
    if not ctx.enabled or not parameters:
        return
    device = _collective_device()
    present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    used = [p for p, flag in zip(parameters, present.tolist()) if flag]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in sorted(used, key=lambda q: str(q.dtype)):  # stable: the same order on every rank
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
