"""Read training checkpoints written by comlrl 1.4.3, so a run started there can resume here.

comlrl 1.4.3 saves ``checkpoint-N/training_state.pt``, one ``torch.save`` file holding the config,
per-agent weights and AdamW state, counters, progress, RNG states, fingerprints and W&B identity,
plus ``checkpoint-N/checkpoint_owner.json`` (``{"run_id", "sequence"}``, written when the run has an
id). Containers in the state file are tagged plain dicts, e.g. a dict is stored as
``{"__kind__": "dict", "items": [[key, value], ...]}``; the other kinds are ``list``, ``tuple``,
``numpy`` (dtype string, shape, raw bytes), ``text`` (a device, dtype or path as a string) and
``record`` (a dataclass: class name and field dict).

Safety: the file is opened only by ``torch.load(..., weights_only=True)``, which builds nothing but
tensors and plain containers, so a planted pickle cannot run code. Decoding accepts only the kinds
above, at most ``MAX_DEPTH`` levels deep; records become plain dicts of their fields and class names
in the file are data, never imported. Every field is checked for type and range; a bad one raises
:class:`~comlrl.exceptions.CheckpointError` naming the checkpoint and the field. State this reader
cannot carry over (stateful callbacks, schedulers, trainer extras, unflushed rollout buffers) is
refused rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..exceptions import CheckpointError

__all__ = ["LegacyCheckpoint", "LegacyRngState", "is_legacy_checkpoint", "read_legacy_checkpoint"]

STATE_FILE = "training_state.pt"
OWNER_FILE = "checkpoint_owner.json"
FORMAT_VERSION = 1
MAX_DEPTH = 32  # real 1.4.3 files nest 8 levels (an AdamW moment inside models/optimizers)
_OWN_STATE_FILE = "trainer_state.json"  # our own format's state file: such a directory is not legacy
# The dataclasses 1.4.3 may store as records; decoded to dicts, never imported.
_RECORDS = {f"comlrl.trainers.{name}" for name in (
    "reinforce.magrpo.NodeSample", "actor_critic.iac.RolloutSample", "preference.madpo.PreferencePair",
    "preference.madpo.AgentPreferenceTensors", "preference.iterative.PreferenceReplayShard")}
_KIND_KEYS = {"dict": {"items"}, "list": {"items"}, "tuple": {"items"}, "text": {"value"},
              "numpy": {"dtype", "shape", "data"}, "record": {"class", "fields"}}
_REQUIRED = {"version", "trainer_class", "config", "dataset", "tokenizers", "models", "optimizers",
             "schedulers", "runtime", "callbacks", "progress", "sequence", "rng", "extra"}
_OPTIONAL = {"run_id", "wandb", "rng_devices"}
_GENERATORS = {"python", "numpy", "torch", "cuda", "mps"}
_OTHER_MODELS = {"critics", "reference_models", "reward_model"}
_TOKENIZER_KEYS = {"class", "vocab", "special_tokens_map", "chat_template", "padding_side",
                   "truncation_side", "model_max_length"}
_SHA256, _RUN_ID = re.compile(r"[0-9a-f]{64}"), re.compile(r"[0-9a-f]{32}")
_WANDB_ID, _WANDB_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}"), re.compile(r"[A-Za-z0-9_.\- ]{1,128}")
_QUALNAME = re.compile(r"[A-Za-z_]\w*(\.([A-Za-z_]\w*|<locals>))+")  # module.qualname, as 1.4.3 records it


class _Invalid(Exception):
    """A field failed validation; re-raised as a CheckpointError that names the checkpoint."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field '{field}': {problem}")


@dataclass(frozen=True)
class LegacyRngState:
    """Generator states captured when the checkpoint was saved."""

    python: tuple  # for random.setstate: (3, (625 ints), None | float)
    numpy: tuple  # for np.random.set_state: ("MT19937", uint32[624], pos, has_gauss, cached_gaussian)
    torch: torch.Tensor  # uint8[S], for torch.set_rng_state
    cuda: Optional[list[torch.Tensor]]  # uint8[S] per CUDA device; None unless CUDA was initialised
    mps: Optional[torch.Tensor]  # uint8[S]; None unless saved on an MPS machine


@dataclass(frozen=True)
class LegacyCheckpoint:
    """Everything resume needs from a 1.4.3 checkpoint, validated. Tensors are on the CPU."""

    path: Path  # the checkpoint directory
    version: int  # always FORMAT_VERSION (1)
    trainer_class: str  # e.g. "comlrl.trainers.reinforce.magrpo.MAGRPOTrainer"
    config: dict[str, Any]  # the non-portable config fields; JSON-like values (tuples become lists)
    sequence: int  # checkpoint counter; for MAGRPO the number of completed epochs
    run_id: Optional[str]  # 32 lowercase hex digits; None for a manual save after a plain train()
    wandb: Optional[dict[str, str]]  # {"id", optional "project", "entity"}
    progress: dict[str, Any]  # {} or {"kind": "magrpo", "epoch": int}
    env_step: int  # joint actions scored so far
    agent_states: list[dict[str, torch.Tensor]]  # per agent: model.state_dict(), tied weights repeated
    optimizer_states: list[dict[str, Any]]  # per agent: AdamW.state_dict(), {"state", "param_groups"}
    model_classes: list[str]  # per agent: module.qualname of the model class
    rng: LegacyRngState
    rng_devices: dict[str, str]  # model slot ("agents.0") -> device of its first parameter at save
    dataset: Optional[dict[str, Any]]  # {"class", "length": int | None, "fingerprint": str | None}
    tokenizers: list[dict[str, str]]  # per agent: {"class", then a sha256 hex per tokenizer property}
    other_models: list[str]  # other saved model groups, e.g. ["reference_models"]

    @property
    def epoch(self) -> int:
        """Completed epochs (0 when the checkpoint has no progress cursor)."""
        return int(self.progress.get("epoch", 0))


def is_legacy_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory holding ``training_state.pt`` (or that file) and no comlrl state file."""
    path = Path(path).expanduser()
    directory = path.parent if path.name == STATE_FILE and path.is_file() else path
    return (directory / STATE_FILE).is_file() and not (directory / _OWN_STATE_FILE).exists()


def read_legacy_checkpoint(path: str | os.PathLike) -> LegacyCheckpoint:
    """Load and validate a 1.4.3 checkpoint directory (or its ``training_state.pt``).

    Raises CheckpointError when the file is missing, truncated, refused by the safe loader, or any
    field is malformed; the message names the checkpoint and the field.
    """
    path = Path(path).expanduser()
    directory = path.parent if path.name == STATE_FILE and not path.is_dir() else path
    raw = _load(directory)
    try:
        state = _table(_decode(raw, STATE_FILE, 0), STATE_FILE)
        checkpoint = _build(directory, state)
        _check_owner(directory, checkpoint.run_id, checkpoint.sequence)
    except _Invalid as exc:
        raise CheckpointError(f"legacy checkpoint {directory}: {exc}") from None
    return checkpoint


def _load(directory: Path) -> Any:
    file = directory / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"legacy checkpoint {directory}: {STATE_FILE} is missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"WeightsUnpickler error: ([^\n]*?)(?: Please use|$)", str(exc), re.M)
        raise CheckpointError(f"legacy checkpoint {directory}: {STATE_FILE} holds objects the safe loader "
                              f"refuses to unpickle ({found.group(1) if found else type(exc).__name__}); "
                              "nothing in it was run or used") from exc
    except Exception as exc:  # a damaged zip surfaces as several exception types; all mean the same
        raise CheckpointError(f"legacy checkpoint {directory}: {STATE_FILE} is truncated or corrupted "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc


# -- decoding the tagged encoding ---------------------------------------------------------------

def _join(where: str, key: Any) -> str:
    return str(key) if where == STATE_FILE else f"{where}.{key}"


def _decode(value: Any, where: str, depth: int) -> Any:
    """Undo 1.4.3's tagging: plain dicts, lists, tuples, strings, numpy arrays; tensors as loaded."""
    if depth > MAX_DEPTH:
        raise _Invalid(where, f"nested deeper than {MAX_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str, bytes) or isinstance(value, torch.Tensor):
        return value
    if type(value) is not dict:
        raise _Invalid(where, f"a {type(value).__name__} is not part of the 1.4.3 encoding")
    kind = value.get("__kind__")
    if not isinstance(kind, str) or kind not in _KIND_KEYS:
        raise _Invalid(where, f"unknown encoding kind {kind!r}")
    if set(value) != _KIND_KEYS[kind] | {"__kind__"}:
        raise _Invalid(where, f"encoded {kind} has keys {sorted(value)}")
    if kind == "dict":
        return _decode_dict(_check(value["items"], where, _is(list), "a list of pairs"), where, depth + 1)
    if kind in ("list", "tuple"):
        items = [_decode(v, f"{where}[{i}]", depth + 1)
                 for i, v in enumerate(_check(value["items"], where, _is(list), "a list"))]
        return tuple(items) if kind == "tuple" else items
    if kind == "text":
        return _check(value["value"], where, _is(str), "a string")
    if kind == "numpy":
        return _decode_numpy(value, where)
    if value["class"] not in _RECORDS or type(value["fields"]) is not dict:
        raise _Invalid(where, f"unsupported record {value['class']!r}")
    return _decode_dict(list(value["fields"].items()), where, depth + 1)


def _decode_dict(pairs: list, where: str, depth: int) -> dict:
    out: dict = {}
    for pair in pairs:
        if type(pair) not in (list, tuple) or len(pair) != 2 or type(pair[0]) not in (str, int):
            raise _Invalid(where, "a dict item is not a [str or int key, value] pair")
        if pair[0] in out:
            raise _Invalid(_join(where, pair[0]), "duplicate key")
        out[pair[0]] = _decode(pair[1], _join(where, pair[0]), depth)
    return out


def _decode_numpy(node: dict, where: str) -> np.ndarray:
    try:
        dtype = np.dtype(_check(node["dtype"], where, _is(str), "a dtype string"))
    except (TypeError, ValueError) as exc:
        raise _Invalid(where, f"bad numpy dtype {node['dtype']!r}") from exc
    shape, data = node["shape"], node["data"]
    if dtype.kind not in "biufc" or type(shape) is not list or type(data) is not bytes:
        raise _Invalid(where, "numpy arrays must be numeric, with a list shape and bytes data")
    if any(type(n) is not int or n < 0 for n in shape) or len(data) != math.prod(shape) * dtype.itemsize:
        raise _Invalid(where, f"numpy shape {shape} does not match {len(data)} bytes of {dtype}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


# -- validating the decoded fields --------------------------------------------------------------

def _is(*types: type) -> Callable[[Any], bool]:
    return lambda value: type(value) in types


def _shown(value: Any) -> str:
    if value is None or type(value) in (bool, int, float, str):
        return f"{type(value).__name__} {repr(value)[:80]}"
    size = f" of length {len(value)}" if type(value) in (list, tuple, dict) else ""
    return f"a {type(value).__name__}{size}"


def _check(value: Any, where: str, ok: Callable[[Any], Any], expected: str) -> Any:
    if not ok(value):
        raise _Invalid(where, f"expected {expected}, found {_shown(value)}")
    return value


def _count(value: Any, where: str, low: int = 0) -> int:
    return _check(value, where, lambda v: type(v) is int and v >= low, f"an int >= {low}")


def _name(value: Any, where: str, pattern: re.Pattern = _QUALNAME,
          expected: str = "a dotted class name") -> str:
    return _check(value, where, lambda v: type(v) is str and pattern.fullmatch(v), expected)


def _table(value: Any, where: str, keys: Optional[set] = None) -> dict:
    _check(value, where, _is(dict), "a dict")
    if keys is not None and set(value) != keys:
        raise _Invalid(where, f"expected keys {sorted(keys)}, found {sorted(map(str, value))}")
    return value


def _plain(value: Any, where: str) -> Any:
    """A JSON-like copy: None, bool, int, finite float, str, lists, str-keyed dicts."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return _check(value, where, math.isfinite, "a finite number")
    if type(value) in (list, tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: _plain(v, _join(where, k)) for k, v in value.items()}
    raise _Invalid(where, f"{_shown(value)} is not a plain JSON-like value")


def _build(directory: Path, state: dict) -> LegacyCheckpoint:
    missing, unknown = _REQUIRED - set(state), set(state) - _REQUIRED - _OPTIONAL
    if missing or unknown:
        raise _Invalid(STATE_FILE, f"missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    for name, empty in (("schedulers", {}), ("callbacks", {}), ("extra", None)):
        if state[name] != empty:
            raise _Invalid(name, "holds trainer or callback state this reader cannot carry over")
    agent_states, model_classes, other_models = _models(state["models"])
    run_id = state.get("run_id")
    return LegacyCheckpoint(
        path=directory,
        version=_check(state["version"], "version", lambda v: _is(int)(v) and v == FORMAT_VERSION,
                       f"format version {FORMAT_VERSION}"),
        trainer_class=_name(state["trainer_class"], "trainer_class"),
        config=_table(_plain(state["config"], "config"), "config"),
        sequence=_count(state["sequence"], "sequence"),
        run_id=None if run_id is None else _name(run_id, "run_id", _RUN_ID, "None or 32 hex digits"),
        wandb=_wandb(state.get("wandb")),
        progress=_progress(state["progress"]),
        env_step=_runtime(state["runtime"], len(agent_states)),
        agent_states=agent_states,
        optimizer_states=_optimizers(state["optimizers"], len(agent_states)),
        model_classes=model_classes,
        rng=_rng(state["rng"]),
        rng_devices=_rng_devices(state.get("rng_devices", {})),
        dataset=_dataset(state["dataset"]),
        tokenizers=_tokenizers(state["tokenizers"]),
        other_models=other_models,
    )


def _wandb(identity: Any) -> Optional[dict[str, str]]:
    """Only plain name strings survive: nothing here is ever passed to wandb.init as keywords."""
    if identity is None:
        return None
    if "id" not in _table(identity, "wandb") or not set(identity) <= {"id", "project", "entity"}:
        raise _Invalid("wandb", f"expected 'id' and optional 'project', 'entity'; found {sorted(identity)}")
    for key, value in identity.items():
        _name(value, f"wandb.{key}", _WANDB_ID if key == "id" else _WANDB_NAME, "a plain name string")
    return dict(identity)


def _progress(progress: Any) -> dict[str, Any]:
    progress = _table(_plain(progress, "progress"), "progress")
    if progress:
        _check(progress.get("kind"), "progress.kind", lambda v: _is(str)(v) and v, "a non-empty string")
    if "epoch" in progress or progress.get("kind") == "magrpo":
        _count(progress.get("epoch"), "progress.epoch")
    if progress.get("kind") == "magrpo":
        _table(progress, "progress", {"kind", "epoch"})
    return progress


def _runtime(runtime: Any, num_agents: int) -> int:
    """env_step; the log throttle and the (necessarily empty) rollout buffers are checked only."""
    if not {"env_step"} <= set(_table(runtime, "runtime")) <= {"env_step", "_last_train_log_step",
                                                              "rollout_buffers"}:
        raise _Invalid("runtime", f"unsupported runtime fields {sorted(runtime)}")
    _count(runtime.get("_last_train_log_step", -1), "runtime._last_train_log_step", low=-1)
    _check(runtime.get("rollout_buffers", [[]] * num_agents), "runtime.rollout_buffers",
           lambda v: v == [[]] * num_agents, f"{num_agents} empty buffers (saves are at epoch boundaries)")
    return _count(runtime["env_step"], "runtime.env_step")


def _component(record: Any, where: str) -> dict:
    """A model or optimizer group: parallel lists of classes, states, metadata, training flags."""
    record = _table(record, where, {"many", "classes", "states", "metadata", "training"})
    _check(record["many"], f"{where}.many", _is(bool), "a bool")
    for key in ("classes", "states", "metadata", "training"):
        _check(record[key], f"{where}.{key}", lambda v: _is(list)(v) and len(v) == len(record["classes"]),
               "a list with one entry per class")
    for i, name in enumerate(record["classes"]):
        _name(name, f"{where}.classes[{i}]")
    return record


def _models(groups: Any) -> tuple[list[dict[str, torch.Tensor]], list[str], list[str]]:
    if "agents" not in _table(groups, "models") or not set(groups) - {"agents"} <= _OTHER_MODELS:
        raise _Invalid("models", f"expected 'agents' and any of {sorted(_OTHER_MODELS)}, "
                                 f"found {sorted(groups)}")
    for group, record in groups.items():
        for i, state in enumerate(_component(record, f"models.{group}")["states"]):
            for name, tensor in _table(state, f"models.{group}.states[{i}]").items():
                at = f"models.{group}.states[{i}].{name}"
                _check(name, at, lambda v: _is(str)(v) and v, "a parameter name")
                _check(tensor, at, lambda v: isinstance(v, torch.Tensor) and v.layout == torch.strided,
                       "a dense tensor")
    agents = groups["agents"]
    if not agents["states"]:
        raise _Invalid("models.agents.states", "no agent was saved")
    return list(agents["states"]), list(agents["classes"]), sorted(set(groups) - {"agents"})


def _optimizers(groups: Any, num_agents: int) -> list[dict[str, Any]]:
    where = "optimizers.optimizers"
    record = _component(_table(groups, "optimizers", {"optimizers"})["optimizers"], where)
    _check(record["states"], f"{where}.states", lambda v: len(v) == num_agents,
           f"one optimizer state per agent ({num_agents})")
    return [_optimizer(state, f"{where}.states[{i}]") for i, state in enumerate(record["states"])]


def _setting(value: Any) -> bool:
    """A param-group setting (lr, betas, eps, flags); a 0-d tensor where lr was a tensor."""
    if type(value) in (list, tuple):
        return all(type(v) in (int, float) for v in value)
    return value is None or type(value) in (bool, int, float, str) or (
        isinstance(value, torch.Tensor) and value.ndim == 0)


def _optimizer(state: Any, where: str) -> dict[str, Any]:
    """A torch optimizer state_dict; ids in "params" index the model's parameters() in order."""
    groups = _table(state, where, {"state", "param_groups"})["param_groups"]
    _check(groups, f"{where}.param_groups", lambda v: _is(list)(v) and v, "a non-empty list")
    ids: list[int] = []
    for g, group in enumerate(groups):
        at = f"{where}.param_groups[{g}]"
        params = _check(_table(group, at).get("params"), f"{at}.params", _is(list), "a list of ids")
        ids += [_count(p, f"{at}.params") for p in params]
        for key, value in group.items():
            if key != "params":
                _check(value, _join(at, key), _setting, "a scalar setting")
    if len(set(ids)) != len(ids):
        raise _Invalid(f"{where}.param_groups", "a parameter id appears twice")
    for pid, slots in _table(state["state"], f"{where}.state").items():
        _check(pid, f"{where}.state.{pid}", lambda v: v in ids, "a parameter id listed in param_groups")
        for key, value in _table(slots, f"{where}.state.{pid}").items():
            _check(value, f"{where}.state.{pid}.{key}",
                   lambda v: isinstance(v, torch.Tensor) or type(v) in (int, float), "a tensor or number")
    return state


def _bytes_state(value: Any, where: str) -> torch.Tensor:
    return _check(value, where, lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.uint8
                  and v.ndim == 1, "a 1-D uint8 tensor")


def _rng(rng: Any) -> LegacyRngState:
    if not {"python", "numpy", "torch"} <= set(_table(rng, "rng")) <= _GENERATORS:
        raise _Invalid("rng", f"unexpected generators {sorted(rng)}")
    _check(rng["python"], "rng.python", _is(tuple), "a tuple")
    _check(rng["numpy"], "rng.numpy", _is(tuple), "a tuple")
    _bytes_state(rng["torch"], "rng.torch")
    # Trial-load into throwaway generators, so a bad state fails here rather than mid-resume.
    for key, load in (("python", random.Random().setstate), ("numpy", np.random.RandomState().set_state),
                      ("torch", torch.Generator().set_state)):
        try:
            load(rng[key])
        except Exception as exc:  # each generator reports bad states with its own exception type
            raise _Invalid(f"rng.{key}", f"not a valid generator state ({exc})") from exc
    cuda = rng.get("cuda")
    if cuda is not None:
        _check(cuda, "rng.cuda", _is(list), "a list")
        cuda = [_bytes_state(t, f"rng.cuda[{i}]") for i, t in enumerate(cuda)]
    mps = None if rng.get("mps") is None else _bytes_state(rng["mps"], "rng.mps")
    return LegacyRngState(python=rng["python"], numpy=rng["numpy"], torch=rng["torch"], cuda=cuda, mps=mps)


def _rng_devices(devices: Any) -> dict[str, str]:
    for slot, device in _table(devices, "rng_devices").items():
        _name(slot, "rng_devices", re.compile(r"\w+\.\d+"), "slot names like 'agents.0'")
        _name(device, f"rng_devices.{slot}", re.compile(r"[a-z]+(:\d+)?"), "a device like 'cpu' or 'cuda:1'")
    return dict(devices)


def _dataset(info: Any) -> Optional[dict[str, Any]]:
    if info is None:
        return None
    _name(_table(info, "dataset", {"class", "length", "fingerprint"})["class"], "dataset.class")
    _check(info["length"], "dataset.length", lambda v: v is None or (_is(int)(v) and v >= 0),
           "None or an int >= 0")
    _check(info["fingerprint"], "dataset.fingerprint", _is(type(None), str), "None or a string")
    return dict(info)


def _tokenizers(tokenizers: Any) -> list[dict[str, str]]:
    for i, info in enumerate(_check(tokenizers, "tokenizers", _is(list), "a list")):
        if "class" not in _table(info, f"tokenizers[{i}]") or not set(info) <= _TOKENIZER_KEYS:
            raise _Invalid(f"tokenizers[{i}]", f"unexpected keys {sorted(map(str, info))}")
        for key, value in info.items():
            _name(value, f"tokenizers[{i}].{key}", *((_QUALNAME, "a class name") if key == "class"
                                                      else (_SHA256, "a sha256 hex digest")))
    return [dict(info) for info in tokenizers]


def _check_owner(directory: Path, run_id: Optional[str], sequence: int) -> None:
    """1.4.3 writes the owner file exactly when the run has an id; it must agree with the state."""
    owner_file = directory / OWNER_FILE
    if not owner_file.exists():
        if run_id is not None:
            raise _Invalid(OWNER_FILE, f"missing, although {STATE_FILE} names run {run_id}")
        return
    try:
        owner = json.loads(owner_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _Invalid(OWNER_FILE, f"unreadable ({exc})") from exc
    if owner != {"run_id": run_id, "sequence": sequence} or type(owner["sequence"]) is not int:
        raise _Invalid(OWNER_FILE, f"{owner!r} disagrees with {STATE_FILE} "
                                   f"(run {run_id}, sequence {sequence})")
