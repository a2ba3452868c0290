"""Checkpoint files of sharded modules (FSDP2), through ``torch.distributed.checkpoint`` (DCP).

Every process writes its shards with DCP's safetensors writer (``HuggingFaceStorageWriter``), which
then consolidates them into whole tensors; the files are renamed to the names an unsharded run
writes (``slot/model.safetensors``, ``slot/optimizer.safetensors``, the same keys), so a checkpoint
is one format whoever wrote it: a sharded run resumes on any number of processes (DCP's reader,
``HuggingFaceStorageReader``, reads each process's part of the whole tensors), an unsharded run or
``from_pretrained`` reads the files as they are. Safetensors and JSON headers only: loading unpickles
nothing. The checkpoint around these files (state, RNG, manifest, hashes, atomic rename) is written
by :mod:`comlrl.checkpoint.files` on rank 0, as always.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..exceptions import CheckpointError
from . import files

__all__ = ["is_sharded_module", "save_sharded_slot", "load_sharded_module", "load_sharded_optimizer",
           "unique_state"]

_CONSOLIDATED = "model-00001-of-00001.safetensors"  # DCP's name of one consolidated file


def is_sharded_module(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensor shards."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with each tied tensor once, under the first name that holds it (the
    input embedding, not its tied output head: the name ``save_pretrained`` keeps)."""
    seen: set[tuple] = set()
    out = {}
    for name, tensor in module.state_dict().items():
        if files.storage_key(tensor) not in seen:
            seen.add(files.storage_key(tensor))
            out[name] = tensor
    return out


def _write(state: dict[str, torch.Tensor], folder: Path, final: Path, is_main: bool) -> None:
    """DCP-save ``state`` (every process its shards) consolidated into one file, moved to ``final``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        str(folder), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping={k: 1 for k in state}))
    dist.barrier()
    if is_main:
        (folder / _CONSOLIDATED).rename(final)
        shutil.rmtree(folder)
    dist.barrier()


def save_sharded_slot(slot_dir: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                      weights_file: str, is_main: bool) -> None:
    """Write a sharded module's weights (``slot_dir/weights_file``) and its optimizer's moments
    (``slot_dir/optimizer.safetensors``, keyed ``<param index>.<name>`` as an unsharded save keys
    them) from every process. A collective: every process calls it with the same arguments."""
    slot_dir.mkdir(parents=True, exist_ok=True)
    _write(unique_state(module), slot_dir / ".dcp-weights", slot_dir / weights_file, is_main)
    if optimizer is not None:
        moments = {f"{index}.{key}": value for index, entry in optimizer.state_dict()["state"].items()
                   for key, value in entry.items() if isinstance(value, torch.Tensor) and key != "step"}
        # the step counts (scalars, the same on every process) go to the checkpoint's JSON:
        # files.steps_as_scalars
        _write(moments, slot_dir / ".dcp-optimizer", slot_dir / files.OPTIMIZER_FILE, is_main)


def _read(state: dict[str, torch.Tensor], folder: Path, what: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
    except Exception as exc:  # noqa: BLE001 - DCP wraps every failure of every rank
        raise CheckpointError(f"checkpoint {folder.parent}: {what} could not be read: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from None


def load_sharded_module(path: Path, slot: str, module: torch.nn.Module) -> None:
    """Read ``slot``'s whole weights into a sharded module, each process its part (any sharding).
    A collective."""
    state = unique_state(module)
    _read(state, path / slot, f"{slot} weights")  # in place: the state dict holds the module's own shards
    bad = sum(int(not bool(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all())) for t in state.values())
    if _any_rank(bad):
        raise CheckpointError(f"checkpoint {path}: {slot} weights hold non-finite values (edited?).")


def load_sharded_optimizer(path: Path, slot: str, optimizer: torch.optim.Optimizer, meta: Any) -> dict[str, Any]:
    """The state dict of ``slot``'s optimizer (for ``optimizer.load_state_dict``) with moments read
    as shards of the optimizer's parameters. A collective."""
    if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list):
        raise CheckpointError(f"checkpoint {path}: optimizers[{slot!r}] is malformed.")
    params = {index: param for group, saved in zip(optimizer.param_groups, meta["param_groups"])
              for index, param in zip(saved.get("params", []), group["params"])}
    from safetensors import safe_open

    with safe_open(str(path / slot / files.OPTIMIZER_FILE), framework="pt") as handle:
        keys = list(handle.keys())
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) not in params:
            raise CheckpointError(f"checkpoint {path}: optimizers[{slot!r}] holds {key!r}, an entry for a parameter "
                                  "this optimizer does not have (edited or forged?); nothing was loaded.")
        param = params[int(index)]
        state[key] = torch.zeros_like(param) if name != "step" else torch.zeros((), dtype=torch.float32)
    _read(state, path / slot, f"{slot} optimizer state")
    return files.join_optimizer_state(meta, state)


def _any_rank(flag: int) -> bool:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return bool(flag)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([flag], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
