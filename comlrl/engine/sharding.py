"""Agents larger than one device: each agent sharded with torch's FSDP2 (``fully_shard``) over the
processes ``torchrun`` starts (``sharding="fsdp2"``).

Every decoder layer of an agent is its own FSDP unit, and the model itself the root unit, so a
process holds 1/world of each agent's parameters, gradients and AdamW state (``sharding_group_size``
shards within groups and replicates across them: HSDP on a 2-D device mesh). What that asks of the
rest of the engine:

* **Sampling** runs on gathered agents (:func:`gathered`): every unit is unsharded once, together on
  every process, and kept so while the agents sample, so that the decode loop's forwards need no
  collective and processes may take different numbers of decode steps; they are resharded after.
* **The update** runs forwards and backwards of sharded units, each a collective (an all-gather of
  a layer's parameters, a reduce-scatter of its gradients): every process must run as many passes as
  the others, so a process with fewer rows (or none) runs idle passes
  (:func:`comlrl.engine.step.idle_passes`) that add nothing to any gradient.
* **Gradients** arrive reduced (averaged) by FSDP: the engine's own all-reduce is skipped for
  sharded modules and the average is turned back into the sum the engine's loss denominators expect.
* **Checkpoints** are written by every process through ``torch.distributed.checkpoint`` into the
  same files an unsharded run writes (:mod:`comlrl.checkpoint.sharded`), so a run resumes on any
  number of processes, sharded or not, and its folders load with ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Sequence

import torch

from ..exceptions import ConfigError
from . import distributed as dist

__all__ = ["fsdp_units", "device_mesh", "shard_model", "mixed_precision_policy", "gathered", "local_fraction"]


def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every FSDP2 unit inside ``module`` (itself included), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def device_mesh(ctx: dist.DistContext, device_type: str, group_size: Optional[int]):
    """A 1-D mesh over every process, or with ``group_size`` a 2-D (replicate, shard) mesh: shards
    within each group of ``group_size`` consecutive ranks, replicas across groups (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = ctx.world_size
    if group_size is None or group_size == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if world % group_size:
        raise ConfigError(f"sharding_group_size={group_size} does not divide the {world} processes; use a divisor "
                          f"of {world} (e.g. the processes of one node).")
    return init_device_mesh(device_type, (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (its ``_no_split_modules`` classes: decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:  # not a transformers model: the children of its longest ModuleList
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        found = list(max(lists, key=len)) if lists else []
    return found


def mixed_precision_policy(param_dtype: Optional[torch.dtype]):
    """FSDP2's policy for ``param_dtype`` (None: none): each unit's parameters gathered in that dtype
    for its forward and backward (one cast of the float32 shards per gather), gradients reduced in
    float32 into the float32 shards that AdamW updates."""
    if param_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, mesh, param_dtype: Optional[torch.dtype] = None) -> None:
    """Shard ``model`` in place: one FSDP unit per repeated block, the model itself the root unit;
    ``param_dtype`` (``mixed_precision="bf16"``): computed in that dtype (:func:`mixed_precision_policy`)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(param_dtype)
    options = {} if policy is None else {"mp_policy": policy}
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


@contextlib.contextmanager
def gathered(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Inside: every sharded model whole on every process, its forwards local (no collective), so
    that sampling may take a different number of steps on each process. Entering and leaving are
    collectives: every process enters together."""
    units = [u for m in models for u in fsdp_units(m)]
    for unit in units:
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True)


def local_fraction(tensors: Sequence[torch.Tensor]) -> float:
    """The share of ``tensors``' elements this process holds (1.0 when nothing is sharded)."""
    from torch.distributed.tensor import DTensor

    total = sum(t.numel() for t in tensors)
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)
    return local / max(total, 1)
