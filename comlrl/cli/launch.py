"""The config a ``comlrl train`` run was launched with, kept in its checkpoints.

``comlrl train`` records the ``trainer:`` section of its config (with the command line's
overrides applied, secrets left out) and where the config file was; every checkpoint of the run
carries it in ``trainer_state.json`` (covered by the manifest's hash). ``comlrl export CHECKPOINT
OUT`` then rebuilds the trainer from it, so the export needs no ``--config``: a checkpoint holds
the trained weights, the record names the base models and inputs they belong to.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

from .._redact import redact
from .runconfig import RunSpec
from .yamlconf import CliError, Document, Key

__all__ = ["launch_record", "recorded_document", "recorded_trainer"]

logger = logging.getLogger("comlrl")


def launch_record(spec: RunSpec) -> Optional[dict[str, Any]]:
    """What a run's checkpoints keep of its config (JSON), or None when it cannot be kept whole.

    Left out: ``wandb_config`` (export logs nothing), secret config fields, and anywhere below,
    every key that names a credential (``token``, ``api_key``, ``password``, an ``Authorization``
    header, ...); a value shaped like one is ``"<redacted>"`` (:mod:`comlrl._redact`, the rule
    every record follows): a checkpoint may be shared, and export needs none of them."""
    trainer = copy.deepcopy(spec.doc.data.get("trainer") or {})
    trainer.pop("wandb_config", None)
    args = trainer.get("args")
    if isinstance(args, dict):
        secret = {f.name for f in dataclasses.fields(spec.entry.config) if f.metadata.get("secret")}
        trainer["args"] = {k: v for k, v in args.items() if k not in secret}
    data = {k: v for k, v in trainer.items() if k.endswith("_dataset")}  # datasets are data, kept as given
    trainer = {**redact({k: v for k, v in trainer.items() if k not in data}, drop=True), **data}
    try:  # checkpoints hold strict JSON: a NaN in an inline dataset cannot be kept as written
        trainer = json.loads(json.dumps(trainer, default=str, allow_nan=False))
    except ValueError:
        logger.info("comlrl: the config holds a non-finite number; it is not recorded in the checkpoints "
                    "(comlrl export will need --config)")
        return None
    return {"config_file": str(spec.doc.file) if spec.doc.file is not None else None,
            "config": {"trainer": trainer}, "cwd": str(Path.cwd())}


def _recorded(checkpoint: Path, meta: dict[str, Any]) -> dict[str, Any]:
    launch = meta.get("launch")
    if launch is None:
        raise CliError(f"{checkpoint} was not trained with `comlrl train`, so it does not record its base models: "
                       "pass --config CONFIG.yaml, a config of the run (its trainer: section).")
    return launch


def recorded_trainer(meta: dict[str, Any]) -> Optional[str]:
    """The registered trainer name a checkpoint's record names (None without a record, or for a
    trainer class from a file, which export refuses to import anyway)."""
    launch = meta.get("launch")
    name = launch["config"]["trainer"].get("name") if launch is not None else None
    return name if isinstance(name, str) and ":" not in name else None


def recorded_document(checkpoint: Path, meta: dict[str, Any], flags: Document) -> Document:
    """The recorded config of ``checkpoint``'s run, made inert, with the overrides of ``flags`` on top.

    A checkpoint may come from anyone, and loading one never runs code it names (the promise of
    every comlrl checkpoint): the recorded functions (reward, formatters, transition, ...) are
    replaced by a stand-in export never calls, and a record that names other code (a trainer or
    object from a file or module, ``trust_remote_code``) is refused: pass ``--config`` instead.
    Relative input paths are looked up next to the original config file, then in the working
    directory, then in the one ``comlrl train`` ran in."""
    launch = _recorded(checkpoint, meta)
    config_file = launch["config_file"]
    label = f"{checkpoint.name}'s recorded config" + (f" ({Path(config_file).name})" if config_file else "")
    doc = Document(data={"trainer": _inert(copy.deepcopy(launch["config"]["trainer"]), label)},
                   file=Path(config_file) if config_file else None, label=label,
                   also_in=(Path(launch["cwd"]),) if launch.get("cwd") else ())
    for key, flag in flags.flags.items():
        doc.set(key, _value_at(flags.data, key), flag)
    return doc


def not_run_by_export(*args: Any, **kwargs: Any) -> Any:
    """What a recorded reward or transition function becomes for ``comlrl export`` (never called)."""
    raise RuntimeError("comlrl export does not run the functions of the run it exports.")


_STAND_IN = f"{__name__}:not_run_by_export"
_SAFE_MODEL_KWARGS = {"dtype", "torch_dtype", "attn_implementation", "low_cpu_mem_usage"}
_KEPT_AS_STAND_IN = ("reward_func", "external_transition")  # required by the trainers' constructors


def _inert(trainer: dict[str, Any], label: str) -> dict[str, Any]:
    from .registry import init_parameters, lookup_trainer
    from .runconfig import _param_kind

    def refuse(what: str) -> CliError:
        return CliError(f"{label}: {what}; comlrl export runs no code a checkpoint names. Pass --config with the "
                        "run's config (your own file) instead.")

    name = trainer.get("name", "MAGRPO")
    if not isinstance(name, str) or ":" in name:
        raise refuse(f"trainer.name {name!r} is a class from a file or module")
    if _mentions(trainer, "trust_remote_code"):
        raise refuse("it sets trust_remote_code")
    try:
        params = init_parameters(lookup_trainer(name).trainer)
    except ValueError as exc:
        raise CliError(f"{label}: trainer.name: {exc}") from None
    out: dict[str, Any] = {}
    args = trainer.get("args")
    if isinstance(args, dict):  # no inference engine and its options: export samples nothing
        trainer["args"] = {k: v for k, v in args.items() if not k.startswith("vllm_")}
        trainer["args"]["rollout_backend"] = "hf"
    options = trainer.get("model_config")
    if isinstance(options, dict) and isinstance(options.get("model_kwargs"), dict):
        unknown = sorted(set(options["model_kwargs"]) - _SAFE_MODEL_KWARGS)
        if unknown:
            raise refuse(f"model_config.model_kwargs sets {', '.join(unknown)}")
    for key, value in trainer.items():
        kind = _param_kind(key, params.get(key)) if key not in ("name", "args") else "plain"
        if kind == "callable":
            if value is not None and key in _KEPT_AS_STAND_IN:
                out[key] = _STAND_IN
            continue
        items = value if isinstance(value, list) else [value]
        if kind != "plain" and any(isinstance(v, dict) and ("call" in v or "ref" in v) for v in items):
            raise refuse(f"trainer.{key} names code to call")  # what build.py would call: {call: ...}, {ref: ...}
        out[key] = value
    return out


def _mentions(value: Any, key: str) -> bool:
    """Whether ``key`` is a mapping key anywhere in ``value``."""
    if isinstance(value, dict):
        return key in value or any(_mentions(v, key) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, key) for v in value)
    return False


def _value_at(data: Any, key: Key) -> Optional[Any]:
    for part in key:
        data = data[part]
    return data
