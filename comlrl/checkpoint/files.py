"""The on-disk format of a checkpoint: writing it atomically, reading and verifying it.

A checkpoint is a directory ``checkpoint-N``::

    checkpoint-N/
      manifest.json                 format version, N, size + sha256 of every other file, and
                                    the sha256 of the manifest itself
      trainer_state.json            counters, data position, RNG states, tracker identity, config,
                                    fingerprints, optimizer / scheduler hyper-state
      rng.safetensors               torch CPU / CUDA generator states (every process's)
      agent-0/                      one folder per trained module (agent-i, critic-i, ...), laid
        model.safetensors           out as the tools people load it with expect (SlotLayout):
        config.json                 a transformers model folder (from_pretrained), a PEFT adapter
        generation_config.json      folder (adapter_config.json + adapter_model.safetensors), a
        tokenizer.json ...          backbone plus value_head.safetensors for value models
        optimizer.safetensors       its optimizer's moments (ignored by those tools)
      ...

Format 2 (before the folders became loadable) had ``model.safetensors`` with the module's whole
state dict and no side files; it is still read.

Tensors live in safetensors and everything else in JSON, so loading never unpickles anything: a
tampered checkpoint cannot run code. Every byte that resume reads is covered by a hash in the
manifest, whose own hash it carries. A checkpoint is written into a hidden temporary sibling,
fsynced, then renamed into place, so a crash at any instant leaves either no ``checkpoint-N`` or a
complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import _remove_duplicate_names, save_file

from .._io import fsync_dir, fsync_tree, move_into_place
from ..exceptions import CheckpointError

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "STATE_FILE", "MANIFEST_FILE", "RNG_FILE", "DATA_FILE",
           "OPTIMIZER_FILE", "SlotLayout", "PLAIN_LAYOUT", "Snapshot", "checkpoint_path", "checkpoint_number",
           "checkpoint_entries", "is_committed", "list_checkpoints", "foreign_checkpoints", "looks_like", "tree_hashes",
           "read_manifest", "read_state", "verify", "snapshot", "write_checkpoint", "temporary_checkpoint_dir", "load_module",
           "read_optimizer", "load_optimizer", "load_tensors", "remove_checkpoints", "storage_key",
           "join_optimizer_state", "steps_as_scalars", "read_verified"]

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)  # 2: one model.safetensors per slot, no side files
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
RNG_FILE = "rng.safetensors"
DATA_FILE = "algorithm.safetensors"  # a trainer family's own tensors (e.g. preference pairs)
OPTIMIZER_FILE = "optimizer.safetensors"
_NAME = re.compile(r"^checkpoint-(\d+)$")
SLOT_NAME = re.compile(r"^[a-z]+(-[a-z]+)*-\d+$")  # agent-0, critic-1, reward-model-0


def checkpoint_path(directory: str | os.PathLike, number: int) -> Path:
    return Path(directory) / f"checkpoint-{number}"


def checkpoint_number(path: str | os.PathLike) -> int:
    """N of a ``checkpoint-N`` directory."""
    match = _NAME.match(Path(path).name)
    if not match:
        raise CheckpointError(f"{path} is not named checkpoint-N.")
    return int(match.group(1))


def checkpoint_entries(directory: str | os.PathLike) -> list[Path]:
    """Every entry of ``directory`` named ``checkpoint-N`` (whatever it is), oldest first by N."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in directory.iterdir() if (m := _NAME.match(child.name))]
    return [path for _, path in sorted(found)]


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a committed comlrl checkpoint: a real directory (not a link) holding a
    manifest. Nothing is verified here (see :func:`verify`)."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST_FILE).is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Committed ``checkpoint-N`` directories (holding a manifest), oldest first by N. Nothing is
    verified here (see :func:`verify`)."""
    return [path for path in checkpoint_entries(directory) if is_committed(path)]


# What other trainers leave in their checkpoint-N folders, to name them in an error.
_HF_TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "pytorch_model.bin",
                     "model.safetensors", "adapter_model.safetensors")


def foreign_checkpoints(directory: str | os.PathLike) -> list[tuple[Path, str]]:
    """``checkpoint-N`` entries of ``directory`` that are not committed comlrl checkpoints (no
    manifest: CoMLRL 1.4.3's, the Hugging Face Trainer's, a copy whose manifest was lost, the
    user's own folder or file, a symbolic link), oldest first by N, each with what it looks like."""
    return [(path, looks_like(path)) for path in checkpoint_entries(directory) if not is_committed(path)]


def looks_like(path: Path) -> str:
    """What a ``checkpoint-N`` entry without a manifest appears to be, for an error message."""
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}"
    if not path.is_dir():
        return "a file"
    names = sorted(p.name for p in path.iterdir())
    if "training_state.pt" in names:
        return "written by CoMLRL 1.4.3 (training_state.pt)"
    if RNG_FILE in names or any(SLOT_NAME.match(n) for n in names):
        return f"a comlrl checkpoint whose {MANIFEST_FILE} is missing (an interrupted copy, or the manifest was lost)"
    if any(n in _HF_TRAINER_FILES for n in names):
        return f"written by the Hugging Face Trainer ({', '.join(n for n in names if n in _HF_TRAINER_FILES)})"
    return f"not a comlrl checkpoint (no {MANIFEST_FILE}; it holds {', '.join(names[:4]) or 'nothing'}" + \
        (", ...)" if len(names) > 4 else ")")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_hashes(root: str | os.PathLike) -> dict[str, str]:
    """``{relative path: sha256}`` of every regular file below ``root``; a symbolic link is not
    followed but listed as ``"link:<its target>"``, which no file's hash equals."""
    root = Path(root)
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[path.relative_to(root).as_posix()] = "link:" + os.readlink(path)
        elif path.is_file():
            out[path.relative_to(root).as_posix()] = _sha256(path)
    return out


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


MAX_JSON_DEPTH = 64  # comlrl's own states nest about 8 levels; deeper is hostile (recursion everywhere)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (comlrl writes strict JSON)")


def _parse_json(raw: bytes, path: Path, name: str) -> Any:
    """Strict JSON (no NaN / Infinity) nested at most :data:`MAX_JSON_DEPTH` levels, or a
    CheckpointError naming the file."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        too_deep = _depth(value) > MAX_JSON_DEPTH
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {name} is corrupted ({exc}).") from None
    except RecursionError:
        too_deep = True
    if too_deep:
        raise CheckpointError(f"checkpoint {path}: {name} nests deeper than {MAX_JSON_DEPTH} levels (corrupted or "
                              "forged).")
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (iteratively: a deep value must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level > MAX_JSON_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked against its own hash, its version and its
    directory's number."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory).")
    file = path / MANIFEST_FILE
    if not file.is_file():
        if (path / "training_state.pt").is_file():
            raise CheckpointError(f"{path} was written by CoMLRL 1.4.3 (training_state.pt); it is read by "
                                  "train(resume_from_checkpoint=...), not as a comlrl checkpoint.")
        raise CheckpointError(f"{path} is not a complete comlrl checkpoint: {MANIFEST_FILE} is missing.")
    manifest = _parse_json(file.read_bytes(), path, MANIFEST_FILE)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sha256"), str):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} has no hash of its own.")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if hashlib.sha256(_canonical(body)).hexdigest() != manifest["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} does not match its own sha256 (corrupted or edited).")
    if body.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {path}: format_version {body.get('format_version')!r} is not one of "
                              f"{list(READABLE_VERSIONS)}; it was written by another comlrl version.")
    number = body.get("checkpoint")
    named = _NAME.match(path.name)
    if not isinstance(number, int) or isinstance(number, bool) or number < 1 or \
            (named is not None and int(named.group(1)) != number):
        raise CheckpointError(f"checkpoint {path}: its manifest says checkpoint {number!r}, its directory name "
                              "another number (renamed or edited).")
    files = body.get("files")
    if not isinstance(files, dict) or STATE_FILE not in files or not all(
            isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str)
            for info in files.values()):
        raise CheckpointError(f"checkpoint {path}: the file list in {MANIFEST_FILE} is malformed.")
    return body


def verify(path: str | os.PathLike, expected: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """Check every file the manifest lists (size and sha256) and, given ``expected``, that exactly
    those files are listed. Returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    if expected is not None:
        verify_listing(path, expected, manifest)
    root = path.resolve()
    for rel, info in files.items():
        target = (path / rel).resolve()
        if root not in target.parents:
            raise CheckpointError(f"checkpoint {path}: file entry {rel!r} points outside the checkpoint.")
        if not target.is_file():
            raise CheckpointError(f"checkpoint {path}: {rel} is missing.")
        size = target.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {rel} has {size} bytes, expected {info['bytes']} "
                                  "(truncated or replaced).")
        if _sha256(target) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {rel} does not match its recorded sha256 (corrupted or "
                                  "tampered).")
    return manifest


def verify_listing(path: Path, expected: Iterable[str], manifest: Optional[dict[str, Any]] = None,
                   side_folders: Iterable[str] = ()) -> None:
    """The manifest lists every ``expected`` file (and the state), and nothing else but side files
    (config, tokenizer files: never read by resume) inside ``side_folders``. A checkpoint's file
    list is complete by construction, so dropping an entry cannot switch off a file's hash check."""
    listed = set((manifest or read_manifest(path))["files"])
    wanted = set(expected) | {STATE_FILE}
    folders = set(side_folders)
    missing = sorted(wanted - listed)
    extra = sorted(rel for rel in listed - wanted if rel.split("/", 1)[0] not in folders or "/" not in rel)
    if missing or extra:
        raise CheckpointError(f"checkpoint {path} does not hold the files this trainer needs: missing "
                              f"{missing or 'none'}, unexpected {extra or 'none'}.")


def read_state(path: str | os.PathLike, manifest: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint, after checking it against the hash in ``manifest``
    (default: the checkpoint's, read now); no tensor file is read."""
    path = Path(path)
    raw = read_verified(path, STATE_FILE, manifest)
    state = _parse_json(raw, path, STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is not a JSON object.")
    return state


# --- optimizer state ---------------------------------------------------------------------------

def read_verified(path: Path, rel: str, manifest: Optional[dict[str, Any]] = None) -> bytes:
    """The bytes of checkpoint file ``rel``, read once (never through a link) and checked against
    ``manifest``'s size and sha256 (default: the checkpoint's manifest, read now). What is
    deserialized is what was hashed: a file replaced after :func:`verify` is refused, never
    loaded. Costs the file's size in host memory while it is deserialized."""
    path = Path(path)
    info = (manifest or read_manifest(path))["files"].get(rel)
    if info is None:
        raise CheckpointError(f"checkpoint {path}: {rel} is not listed in its {MANIFEST_FILE}.")
    try:
        fd = os.open(path / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: {rel} cannot be read ({exc.strerror or exc}; missing, or a "
                              "link).") from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(info["bytes"] + 1)  # one byte more than recorded: a longer file shows
    if len(raw) != info["bytes"] or hashlib.sha256(raw).hexdigest() != info["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {rel} is missing or does not match its recorded sha256 (corrupted, "
                              "edited, or replaced while it was loaded); nothing of it was loaded.")
    return raw


def _load_verified(path: Path, rel: str, manifest: Optional[dict[str, Any]],
                   device: Optional[str] = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of safetensors file ``rel``, from the bytes that were hashed."""
    from safetensors.torch import load as load_bytes

    raw = read_verified(path, rel, manifest)
    tensors = load_bytes(raw)
    length = int.from_bytes(raw[:8], "little")  # valid: load() parsed this header
    metadata = json.loads(raw[8:8 + length]).get("__metadata__") or {}
    del raw
    if device is not None and device != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, metadata


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


def join_optimizer_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    for entry in state.values():  # a sharded save keeps the step counts in the JSON: torch's optimizers want tensors
        if isinstance(entry.get("step"), (int, float)) and not isinstance(entry["step"], bool):
            entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
    return {"state": state, "param_groups": meta["param_groups"]}


def steps_as_scalars(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Move each parameter's scalar ``step`` from ``tensors`` into ``meta["scalars"]`` (a sharded
    module's moments are written by every process, its step counts, the same on all, here)."""
    for name in [n for n in tensors if n.endswith(".step")]:
        index = name.split(".", 1)[0]
        meta["scalars"].setdefault(index, {})["step"] = float(tensors.pop(name).item())


# --- save ------------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """Everything a checkpoint will hold, copied out of the live training state.

    Taking it is quick (tensor copies in memory); writing it (:func:`write_checkpoint`) is the slow
    part and may run while training goes on, since nothing here changes when training does.
    """

    number: int
    record: dict[str, Any]                                                      # trainer_state.json
    files: dict[str, tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]]  # path -> (tensors, metadata)
    sidecars: dict[str, bytes] = field(default_factory=dict)                    # path -> bytes (config, ...)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors, _ in self.files.values() for t in tensors.values())


def _copies(tensors: Mapping[str, torch.Tensor], reuse: Optional[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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


@dataclass(frozen=True)
class SlotLayout:
    """How one trained module is stored in its folder ``slot/`` of a checkpoint.

    Attributes:
        parts: ``(prefix, file)`` pairs. The module's state-dict entries whose key starts with
            ``prefix`` (the longest matching prefix wins; ``""`` takes the rest) go to ``slot/file``
            with the prefix cut off, so each file holds the keys the tool that reads it expects:
            ``model.safetensors`` of a transformers model, ``adapter_model.safetensors`` of a PEFT
            adapter, ``value_head.safetensors`` of a value head.
        sidecars: small files written byte for byte beside them (``config.json``, tokenizer files,
            ``adapter_config.json``, ...): what makes the folder loadable elsewhere. Resume never
            reads them; the manifest hashes them like every other file.
    """

    parts: tuple[tuple[str, str], ...] = (("", "model.safetensors"),)
    sidecars: Mapping[str, bytes] = field(default_factory=dict)

    def files(self) -> list[str]:
        """The weight files, in part order."""
        return [file for _, file in self.parts]

    def split(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """``{file: {key without prefix: tensor}}`` of a state dict."""
        prefixes = sorted(self.parts, key=lambda part: -len(part[0]))
        out: dict[str, dict[str, torch.Tensor]] = {file: {} for _, file in self.parts}
        for key, tensor in state_dict.items():
            prefix, file = next(((p, f) for p, f in prefixes if key.startswith(p)), (None, None))
            if file is None:
                raise ValueError(f"state-dict key {key!r} belongs to no part of the layout {self.parts}")
            out[file][key[len(prefix):]] = tensor
        return out


PLAIN_LAYOUT = SlotLayout()  # the whole state dict in model.safetensors: format 2, and modules of unknown kind


def _dedupe(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """Drop the aliases of tied tensors from ``state_dict`` in place, keeping the name that comes
    first (a transformers model's input embedding, not its tied ``lm_head``: the name
    ``save_pretrained`` keeps, which vLLM and other loaders look for). Returns ``{alias: kept}``."""
    order = {name: i for i, name in enumerate(state_dict)}
    groups = _remove_duplicate_names(state_dict)
    firsts = [min([kept, *removed], key=order.__getitem__) for kept, removed in groups.items()]
    aliases = {}
    for kept, removed in _remove_duplicate_names(state_dict, preferred_names=firsts).items():
        for name in removed:
            aliases[name] = kept
            del state_dict[name]
    return aliases


def _part_tensors(module: torch.nn.Module, layout: SlotLayout
                  ) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """``{file: (tensors, metadata)}`` of a module's weights under ``layout``: tied tensors listed
    once with their aliases in the metadata (read back by :func:`load_module`), and
    ``format: pt`` as transformers writes it."""
    out = {}
    for file, tensors in layout.split(module.state_dict()).items():
        out[file] = (tensors, {**_dedupe(tensors), "format": "pt"})
    return out


def snapshot(number: int, record: dict[str, Any], modules: Mapping[str, torch.nn.Module],
             optimizers: Mapping[str, torch.optim.Optimizer], rng_tensors: Mapping[str, torch.Tensor],
             reuse: Optional[Snapshot] = None, data: Optional[Mapping[str, torch.Tensor]] = None,
             layouts: Optional[Mapping[str, SlotLayout]] = None, prewritten: frozenset[str] = frozenset()) -> Snapshot:
    """Copy what checkpoint ``number`` will hold.

    Args:
        record: the JSON state (counters, config, ...); optimizer hyper-state is added here.
        modules: ``{slot: module}``, e.g. ``{"agent-0": model}``; weights go to ``slot/`` as
            ``layouts[slot]`` says (default :data:`PLAIN_LAYOUT`), with its side files.
        optimizers: ``{slot: optimizer}``; moments go to ``slot/optimizer.safetensors``.
        rng_tensors: generator states for ``rng.safetensors``.
        reuse: an earlier snapshot whose files are written (or abandoned); its tensors are
            overwritten and become this snapshot's, instead of allocating new ones.
        data: a trainer family's own tensors, for :data:`DATA_FILE` (None: no such file).
        prewritten: slots whose weight and optimizer files are already written (sharded modules,
            :mod:`comlrl.checkpoint.sharded`): only their side files and optimizer hyper-state here.
    """
    record = json.loads(json.dumps(record, allow_nan=False))  # a frozen copy: the live state keeps changing
    old = reuse.files if reuse is not None else {}
    files: dict[str, tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]] = {
        RNG_FILE: ({k: v.clone() for k, v in rng_tensors.items()}, None)}
    sidecars: dict[str, bytes] = {}
    for slot, module in modules.items():
        if not SLOT_NAME.match(slot):
            raise ValueError(f"bad checkpoint slot name {slot!r}")
        layout = (layouts or {}).get(slot, PLAIN_LAYOUT)
        for file, (weights, metadata) in ({} if slot in prewritten else _part_tensors(module, layout)).items():
            name = f"{slot}/{file}"
            files[name] = (_copies(weights, old.get(name, ({}, None))[0]), metadata)
        sidecars.update({f"{slot}/{name}": content for name, content in layout.sidecars.items()})
    if data is not None:
        files[DATA_FILE] = ({k: v.detach().to("cpu").contiguous().clone() for k, v in data.items()}, None)
    record["optimizers"] = {}
    for slot, optimizer in optimizers.items():
        meta, tensors = _split_optimizer_state(optimizer.state_dict())
        name = f"{slot}/{OPTIMIZER_FILE}"
        if slot in prewritten:
            steps_as_scalars(meta, tensors)
        else:
            files[name] = (_copies(tensors, old.get(name, ({}, None))[0]), None)
        record["optimizers"][slot] = json.loads(json.dumps(meta))
    return Snapshot(number, record, files, sidecars)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]]) -> None:
    """One file of a checkpoint (a seam for the tests that kill a save half-way). ``save_file``
    rather than serialising to bytes in Python: it holds the GIL for less of the time, which
    matters when the write runs beside training."""
    save_file(tensors, str(path), metadata=metadata)


def temporary_checkpoint_dir(directory: str | os.PathLike, number: int) -> Path:
    """A new hidden directory beside ``checkpoint-number`` for a checkpoint being written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-checkpoint-{number}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def write_checkpoint(directory: str | os.PathLike, snap: Snapshot, name: Optional[str] = None,
                     prewritten: Optional[Path] = None) -> Path:
    """Write ``snap`` as ``directory/checkpoint-N`` (or ``directory/name``) atomically and return
    its path.

    Files go into a hidden temporary directory and are hashed there; then the state, then the
    manifest; all is fsynced and renamed into place. On any failure the temporary directory is
    removed and an existing ``checkpoint-N`` is left as it was. ``prewritten``: that temporary
    directory (from :func:`temporary_checkpoint_dir`), already holding files written by every
    process (sharded modules); they are hashed and listed with the rest.
    """
    directory = Path(directory)
    final = directory / name if name is not None else checkpoint_path(directory, snap.number)
    tmp = prewritten if prewritten is not None else temporary_checkpoint_dir(directory, snap.number)
    try:
        files = {}
        for rel, (tensors, metadata) in snap.files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_tensors(target, tensors, metadata)
            files[rel] = {"bytes": target.stat().st_size, "sha256": _sha256(target)}
        for rel, content in snap.sidecars.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            files[rel] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        if prewritten is not None:  # the files every process wrote (sharded modules)
            for target in sorted(p for p in tmp.rglob("*") if p.is_file()):
                rel = target.relative_to(tmp).as_posix()
                if rel not in files:
                    files[rel] = {"bytes": target.stat().st_size, "sha256": _sha256(target)}
        state_bytes = json.dumps(snap.record, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
        (tmp / STATE_FILE).write_bytes(state_bytes)
        files[STATE_FILE] = {"bytes": len(state_bytes), "sha256": hashlib.sha256(state_bytes).hexdigest()}
        body = {"format_version": FORMAT_VERSION, "checkpoint": snap.number, "files": dict(sorted(files.items()))}
        manifest = {**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        fsync_tree(tmp)
        move_into_place(tmp, final)  # re-saving a number (resumed from an older checkpoint) swaps it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --- load ----------------------------------------------------------------------------------------

def _loading(path: Path, what: str):
    """Turn a safetensors / torch error while loading ``what`` into a CheckpointError."""
    class _Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if exc is not None and isinstance(exc, (SafetensorError, RuntimeError, KeyError, ValueError, TypeError)) \
                    and not isinstance(exc, CheckpointError):
                raise CheckpointError(f"checkpoint {path}: {what} could not be loaded: {type(exc).__name__}: "
                                      f"{exc}") from exc
            return False
    return _Guard()


def load_module(path: Path, slot: str, module: torch.nn.Module, layout: SlotLayout = PLAIN_LAYOUT,
                manifest: Optional[dict[str, Any]] = None) -> None:
    """Load ``slot/``'s weight files (``layout``'s parts) into ``module`` in place (strict: every
    tensor must fit, none may be missing), each from bytes checked against ``manifest``."""
    with _loading(path, f"{slot} weights"):
        device = str(next(module.parameters()).device)
        state: dict[str, torch.Tensor] = {}
        for prefix, file in layout.parts:
            tensors, metadata = _load_verified(path, f"{slot}/{file}", manifest, device)
            for alias, kept in _aliases(metadata).items():
                if kept in tensors and alias not in tensors:
                    tensors[alias] = tensors[kept]
            state.update({prefix + key: value for key, value in tensors.items()})
        missing, unexpected = module.load_state_dict(state, strict=False)
        missing = _untied(module, missing, state)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path}: {slot} weights do not fit the model (missing "
                                  f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}).")
        bad = next((n for n, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:  # never written by comlrl (a save refuses non-finite weights): edited
            raise CheckpointError(f"checkpoint {path}: {slot} weight {bad} holds non-finite values (edited?).")


def _untied(module: torch.nn.Module, missing: list[str], loaded: Mapping[str, torch.Tensor]) -> list[str]:
    """``missing`` without the tied aliases of loaded tensors (a file written without alias
    metadata, e.g. by a sharded save or ``save_pretrained``, lists a tied tensor once)."""
    if not missing:
        return missing
    holder = {name: storage_key(tensor) for name, tensor in module.state_dict().items()}
    loaded_keys = {holder[name] for name in loaded if name in holder}
    return [name for name in missing if holder.get(name) not in loaded_keys]


def storage_key(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live (a shard's, for a DTensor): equal for tied tensors."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)


def _aliases(metadata: Mapping[str, str]) -> dict[str, str]:
    """``{alias: kept}`` of the tied tensors a weight file lists once (its metadata)."""
    return {alias: kept for alias, kept in metadata.items() if alias != "format"}


def read_optimizer(path: Path, slot: str, meta: Any, manifest: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``slot/optimizer.safetensors`` joined with its JSON hyper-state ``meta``: the state dict
    ``optimizer.load_state_dict`` takes (checked by :mod:`comlrl.checkpoint.hyper` before that)."""
    with _loading(path, f"{slot} optimizer state"):
        if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list) \
                or not isinstance(meta.get("scalars"), dict) or \
                not all(isinstance(v, dict) for v in meta["scalars"].values()):
            raise CheckpointError(f"checkpoint {path}: optimizers[{slot!r}] is malformed.")
        tensors, _ = _load_verified(path, f"{slot}/{OPTIMIZER_FILE}", manifest)
        return join_optimizer_state(meta, tensors)


def load_optimizer(path: Path, slot: str, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state from :func:`read_optimizer` into ``optimizer``."""
    with _loading(path, f"{slot} optimizer state"):
        optimizer.load_state_dict(state)


def load_tensors(path: Path, rel: str, manifest: Optional[dict[str, Any]] = None) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file of the checkpoint (e.g. :data:`RNG_FILE`), from bytes
    checked against ``manifest``."""
    with _loading(path, rel):
        return _load_verified(path, rel, manifest)[0]


def remove_checkpoints(paths: Iterable[Path]) -> None:
    """Delete checkpoints; each is renamed to a hidden name first, so a crash mid-delete never
    leaves a half-deleted ``checkpoint-N`` that looks usable."""
    for path in paths:
        trash = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
