"""The one owner of saving and loading training state.

A checkpoint is a directory ``checkpoint-N``::

    checkpoint-N/
      trainer_state.json          counters, data position, RNG states, W&B identity, config,
                                  fingerprints, optimizer/scheduler hyper-state, file sizes + sha256
      rng.safetensors             torch CPU / CUDA generator states
      agent-0/model.safetensors   agent 0 weights
      agent-0/optimizer.safetensors  agent 0 AdamW moments
      agent-1/...

Tensors live in safetensors and everything else in JSON, so loading never unpickles anything: a
tampered checkpoint cannot run code. Every file's size and sha256 are recorded and verified on load.
A checkpoint is written into a hidden temporary sibling, fsynced, then renamed into place, so a
crash at any instant leaves either no ``checkpoint-N`` or a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import _remove_duplicate_names, load_file, load_model, save_file

from .exceptions import CheckpointError
from ._io import fsync_dir, fsync_tree, move_into_place

__all__ = [
    "FORMAT_VERSION",
    "STATE_FILE",
    "checkpoint_path",
    "checkpoint_number",
    "list_checkpoints",
    "latest_checkpoint",
    "read_state",
    "save_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_checkpoints",
    "capture_rng_state",
    "restore_rng_state",
]

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_path(directory: str | os.PathLike, number: int) -> Path:
    return Path(directory) / f"checkpoint-{number}"


def checkpoint_number(path: str | os.PathLike) -> int:
    """N of a ``checkpoint-N`` directory."""
    match = _NAME.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not named checkpoint-N.")
    return int(match.group(1))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Committed ``checkpoint-N`` directories (with a state file), oldest first by N."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint in ``directory`` (verified), or None if there is none.

    A directory that fails verification (truncated or corrupted files) is skipped, so a damaged
    newest checkpoint falls back to the one before it.
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            verify_files(path, read_state(path))
        except CheckpointError:
            continue
        return path
    return None


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """Parse ``trainer_state.json`` of a checkpoint (JSON only; no tensors are read)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete comlrl checkpoint: {STATE_FILE} is missing.")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is corrupted ({exc}).") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: unsupported or missing format_version "
            f"{state.get('format_version') if isinstance(state, dict) else None!r} (expected {FORMAT_VERSION})."
        )
    return state


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_files(path: Path, state: dict[str, Any]) -> None:
    """Check that every file the state lists exists with the recorded size and sha256."""
    files = state.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"checkpoint {path}: the file list in {STATE_FILE} is missing.")
    for rel, info in files.items():
        target = (path / rel).resolve()
        if path.resolve() not in target.parents:
            raise CheckpointError(f"checkpoint {path}: file entry {rel!r} points outside the checkpoint.")
        if not target.is_file():
            raise CheckpointError(f"checkpoint {path}: {rel} is missing.")
        size = target.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {rel} has {size} bytes, expected {info.get('bytes')} (truncated or replaced)."
            )
        if _sha256(target) != info.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {rel} does not match its recorded sha256 (corrupted or tampered).")


# --- random states -------------------------------------------------------------------------------

def capture_rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python, NumPy, torch CPU and CUDA generator states: (JSON part, tensor part)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    json_part = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    return json_part, tensors


def restore_rng_state(json_part: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = json_part["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        # Same device count: exact. A different count (moved machine) restores what matches.
        cuda_keys = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
        states = [tensors[k] for k in cuda_keys]
        for i, s in enumerate(states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# --- optimizer state ---------------------------------------------------------------------------

def _split_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach()
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars}
    json.dumps(meta)  # fail here, at save time, on anything JSON cannot hold
    return meta, tensors


def _join_optimizer_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


# --- save / load ---------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """Everything a checkpoint will hold, copied out of the live training state.

    Taking it is quick (tensor copies in memory); writing it (:func:`write_checkpoint`) is the slow
    part and may then run while training goes on, since nothing here changes when training does.
    """

    record: dict[str, Any]                                      # the JSON state, without the manifest
    files: dict[str, tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]]  # path -> (tensors, metadata)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors, _ in self.files.values() for t in tensors.values())


def _copies(tensors: dict[str, torch.Tensor], reuse: Optional[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of ``tensors``, written into ``reuse``'s buffers where they fit
    (no fresh allocation, hence no page faults, for every save of a run)."""
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        buffer = reuse.get(name) if reuse else None
        if buffer is not None and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype:
            out[name] = buffer.copy_(tensor)
        else:
            out[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)
    return out


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]:
    """The state dict with tied tensors listed once, as ``safetensors.torch.save_model`` writes it
    (so ``load_model`` reads it back the same way), and the metadata naming the dropped aliases."""
    state_dict = model.state_dict()
    metadata: Optional[dict[str, str]] = None
    for kept, removed in _remove_duplicate_names(state_dict).items():
        for name in removed:
            metadata = metadata or {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    return state_dict, metadata


def snapshot_checkpoint(number: int, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                        schedulers: Sequence[Any], state: dict[str, Any],
                        rng_states: Optional[Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]] = None,
                        reuse: Optional[Snapshot] = None) -> Snapshot:
    """Copy what checkpoint ``number`` will hold (see :func:`save_checkpoint` for the arguments).

    ``reuse``: an earlier snapshot whose files are written (or abandoned); its tensors are
    overwritten and become this snapshot's, instead of allocating new ones.
    """
    record = json.loads(json.dumps(state))  # a frozen copy: the live state keeps changing
    record["format_version"] = FORMAT_VERSION
    record["checkpoint"] = number
    ranks = list(rng_states) if rng_states is not None else [capture_rng_state()]
    record["world_size"] = len(ranks)
    record["rng"] = ranks[0][0]
    record["rng_other_ranks"] = [json_part for json_part, _ in ranks[1:]]
    rng_tensors = {k: v.clone() for k, v in ranks[0][1].items()}
    for r, (_, tensors) in enumerate(ranks[1:], start=1):
        rng_tensors.update({f"rank{r}/{k}": v.clone() for k, v in tensors.items()})
    files: dict[str, tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]] = {"rng.safetensors": (rng_tensors, None)}
    record["optimizers"] = []
    old = reuse.files if reuse is not None else {}
    for i, (model, optimizer) in enumerate(zip(models, optimizers)):
        name = f"agent-{i}/model.safetensors"
        weights, metadata = _model_tensors(model)
        files[name] = (_copies(weights, old.get(name, ({}, None))[0]), metadata)
        meta, tensors = _split_optimizer_state(optimizer.state_dict())
        name = f"agent-{i}/optimizer.safetensors"
        files[name] = (_copies(tensors, old.get(name, ({}, None))[0]), None)
        record["optimizers"].append(json.loads(json.dumps(meta)))
    record["schedulers"] = [json.loads(json.dumps(s.state_dict())) for s in schedulers]
    return Snapshot(record, files)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]]) -> None:
    """One file of a checkpoint (a seam for the tests that kill a save half-way). ``save_file``
    rather than serialising to bytes in Python: it holds the GIL for less of the time, which
    matters when the write runs beside training."""
    save_file(tensors, str(path), metadata=metadata)


def write_checkpoint(directory: str | os.PathLike, number: int, snapshot: Snapshot) -> Path:
    """Write ``snapshot`` as ``directory/checkpoint-{number}`` atomically and return its path.

    Files are written into a hidden temporary directory and hashed, which is fsynced and then
    renamed into place.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, number)
    tmp = directory / f".tmp-checkpoint-{number}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        record = dict(snapshot.record)
        manifest = {}
        for rel, (tensors, metadata) in snapshot.files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_tensors(target, tensors, metadata)
            manifest[rel] = {"bytes": target.stat().st_size, "sha256": _sha256(target)}
        record["files"] = dict(sorted(manifest.items()))
        state_file = tmp / STATE_FILE
        with open(state_file, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_tree(tmp)
        move_into_place(tmp, final)  # re-saving a number (resumed from an older checkpoint) swaps it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_checkpoint(directory: str | os.PathLike, number: int, models: Sequence[torch.nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
                    state: dict[str, Any],
                    rng_states: Optional[Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]] = None) -> Path:
    """Write ``directory/checkpoint-{number}`` atomically and return its path.

    ``state`` is the trainer's JSON-ready record (counters, config, fingerprints, ...); this
    function adds RNG states, optimizer/scheduler hyper-state and the file manifest.
    ``rng_states``: every rank's :func:`capture_rng_state` in rank order (data parallel); None =
    this process's only. Rank 0's are stored as in a one-process checkpoint, rank r's tensors under
    ``rank{r}/...`` and its JSON part in ``rng_other_ranks[r - 1]``.
    Equivalent to :func:`write_checkpoint` of :func:`snapshot_checkpoint`.
    """
    return write_checkpoint(directory, number, snapshot_checkpoint(number, models, optimizers, schedulers, state,
                                                                   rng_states))


def load_checkpoint(path: str | os.PathLike, models: Sequence[torch.nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
                    restore_rng: bool = True, rank: int = 0) -> dict[str, Any]:
    """Verify ``path`` and load weights, optimizer and scheduler state and RNG states in place.

    ``rank``: whose random states to restore (data parallel). A checkpoint written by fewer
    processes gives the extra ranks rank 0's states (the caller says so to the user).

    Returns the checkpoint's JSON state. Raises :class:`CheckpointError` naming the checkpoint and
    the problem for anything missing, truncated, corrupted, tampered or of the wrong shape.
    """
    path = Path(path)
    state = read_state(path)
    verify_files(path, state)
    if len(state.get("optimizers", [])) != len(models):
        raise CheckpointError(
            f"checkpoint {path} holds {len(state.get('optimizers', []))} agent(s); this trainer has {len(models)}."
        )
    try:
        for i, (model, optimizer) in enumerate(zip(models, optimizers)):
            missing, unexpected = load_model(model, str(path / f"agent-{i}" / "model.safetensors"),
                                             strict=False, device=str(next(model.parameters()).device))
            if missing or unexpected:
                raise CheckpointError(f"checkpoint {path}: agent-{i} weights do not fit the model "
                                      f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}).")
            tensors = load_file(str(path / f"agent-{i}" / "optimizer.safetensors"))
            optimizer.load_state_dict(_join_optimizer_state(state["optimizers"][i], tensors))
        for scheduler, saved in zip(schedulers, state.get("schedulers", [])):
            scheduler.load_state_dict(saved)
        if restore_rng:
            tensors = load_file(str(path / "rng.safetensors"))
            saved_ranks = int(state.get("world_size", 1))
            if 0 < rank < saved_ranks:
                prefix = f"rank{rank}/"
                restore_rng_state(state["rng_other_ranks"][rank - 1],
                                  {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            else:
                restore_rng_state(state["rng"], {k: v for k, v in tensors.items() if "/" not in k})
    except CheckpointError:
        raise
    except (SafetensorError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc
    return state


def remove_checkpoints(paths: Sequence[Path]) -> None:
    """Delete checkpoints; each is renamed to a hidden name first, so a crash mid-delete never
    leaves a half-deleted ``checkpoint-N`` that looks usable."""
    for path in paths:
        trash = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints; return what was removed."""
    existing = list_checkpoints(directory)
    doomed = existing[: max(0, len(existing) - keep)]
    remove_checkpoints(doomed)
    return doomed
