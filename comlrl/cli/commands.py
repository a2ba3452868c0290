"""The commands: ``train``, ``checkpoints``, ``export``, ``plot``, ``trainers``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .._imports import install_hint
from ..exceptions import CheckpointError, ComlrlError, ResumeMismatchError
from .launch import launch_record, recorded_document, recorded_trainer
from .registry import available_trainers
from .build import build_trainer
from .runconfig import TRAIN_EXTRAS, RunSpec, check_run, locate_error, parse_run_args
from .yamlconf import CliError

__all__ = ["train", "export", "checkpoints", "plot", "trainers"]


def _is_main_process() -> bool:
    """Rank 0 under torchrun (every rank runs the same command; one of them reports)."""
    return os.environ.get("RANK", "0") == "0"


def _say(message: str) -> None:
    if _is_main_process():
        print(message, flush=True)


# --- train ----------------------------------------------------------------------------------------

def _train_fixed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="the run's YAML config")


def train(argv: Sequence[str]) -> int:
    """``comlrl train CONFIG.yaml [--key value ...]``."""
    _, doc, entry = parse_run_args(argv, "comlrl train", "comlrl train CONFIG.yaml [--resume auto] [--KEY VALUE ...]",
                                   "Train the agents of a YAML config.", _train_fixed)
    spec = check_run(doc, entry)
    options = {k: v for k, v in spec.train_values.items() if k not in TRAIN_EXTRAS}
    _check_output_paths(spec, options)  # before any model is loaded
    checkpoint = _resume_target(spec, options.pop("resume_from_checkpoint", None), options.get("checkpoint_dir"))
    if checkpoint is None:
        _refuse_a_used_directory(spec, options.get("checkpoint_dir"))  # before any model is loaded
    wandb_config = spec.trainer_values.get("wandb_config")
    identity = None
    if checkpoint is not None:
        from ..utils import read_checkpoint_metadata

        identity = read_checkpoint_metadata(checkpoint)["wandb"]
        if identity and wandb_config is not None:  # the same W&B run (the README's resume recipe)
            wandb_config = {**wandb_config, **identity, "resume": "allow"}
    try:
        trainer = build_trainer(spec, wandb_config=wandb_config)
    except ComlrlError as exc:
        raise CliError(locate_error(spec, exc)) from None
    trainer.launch_config = launch_record(spec)  # in every checkpoint: `comlrl export` needs no --config
    with trainer:
        try:
            if checkpoint is not None:
                trainer.check_resumable(checkpoint)  # a refused resume starts no tracker and says nothing more
                if identity and wandb_config is not None:
                    _say(f"comlrl: continuing W&B run {identity['id']}")
            metrics = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None, **options)
        except ComlrlError as exc:
            raise CliError(locate_error(spec, exc)) from None
        save_to = spec.train_values.get("save_model")
        if save_to:
            trainer.save_model(save_to, merge_adapters=bool(spec.train_values.get("merge_adapters", False)))
        _report(spec, trainer, metrics or {}, options, save_to)
    return 0


def _check_output_paths(spec: RunSpec, options: dict[str, Any]) -> None:
    """Every directory the run will write must be one, or creatable: a file in its place (or in the
    place of a folder above it) is said now, naming the key, not after the models have loaded."""
    wandb_config = spec.trainer_values.get("wandb_config")
    legacy_output = wandb_config.get("output_dir") if isinstance(wandb_config, dict) else None
    places = [(("train", "checkpoint_dir"), options.get("checkpoint_dir")),
              (("train", "save_model"), spec.train_values.get("save_model")),
              (("trainer", "wandb_config", "output_dir"), legacy_output)]
    if not options.get("checkpoint_dir") and legacy_output is None:  # metrics.jsonl then goes to output_dir
        places.append((("trainer", "args", "output_dir"), getattr(spec.config, "output_dir", None)))
    for key, value in places:
        if not value or not isinstance(value, (str, os.PathLike)):
            continue
        path = Path(value).expanduser()
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            what = "is a file" if blocker == path else f"cannot be created: {blocker} is a file"
            raise CliError(f"{spec.doc.where(key)}: {value} {what}, not a directory; nothing was loaded. Point it "
                           "at a directory (a new or an existing one).")


def _refuse_a_used_directory(spec: RunSpec, checkpoint_dir: Any) -> None:
    """A new run refuses a checkpoint_dir that already holds checkpoints, with the command line's
    advice, before loading anything (train() would refuse it too, once the models are loaded)."""
    from ..checkpoint.files import checkpoint_entries

    if not checkpoint_dir:
        return
    found = [p.name for p in checkpoint_entries(checkpoint_dir)]
    if found:
        where = spec.doc.where(("train", "checkpoint_dir"))
        raise CliError(f"{where}: {checkpoint_dir} already holds {', '.join(found[:3])}"
                       f"{' ...' if len(found) > 3 else ''} of an earlier run; nothing was loaded or touched. Pass "
                       "--resume auto to continue that run, or set --checkpoint_dir to a new directory.")


def _resume_target(spec: RunSpec, resume: Any, checkpoint_dir: Any) -> Optional[Path]:
    if resume is None:
        return None
    where = spec.doc.where(("train", "resume_from_checkpoint"))
    if not isinstance(resume, str):
        raise CliError(f"{where}: must be 'auto' or a checkpoint-N directory, got {resume!r}.")
    if resume != "auto":
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise CliError(f"{where}: checkpoint {resume} does not exist.")
        return path
    if not checkpoint_dir:
        raise CliError(f"{where}: 'auto' resumes from train.checkpoint_dir, which is not set.")
    from ..utils import find_latest_checkpoint

    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is None:
        _say(f"comlrl: no checkpoint to resume in {checkpoint_dir}; starting a new run")
    else:
        _say(f"comlrl: resuming from {latest}")
    return latest


def _report(spec: RunSpec, trainer: Any, metrics: dict[str, Any], options: dict[str, Any],
            save_to: Optional[str]) -> None:
    from ..tracking.trackers import active_trackers

    state = trainer.state
    reward = metrics.get("train/reward_mean")
    shown = f"; last train/reward_mean {reward:.4f}" if isinstance(reward, (int, float)) else ""
    steps = f"{state.global_step} optimizer step" + ("" if state.global_step == 1 else "s")
    _say(f"comlrl: {spec.entry.name} trained to epoch {state.epoch} (env_step {state.env_step}, {steps}){shown}")
    directory = options.get("checkpoint_dir")
    folder = Path(directory) if directory else Path(trainer.args.output_dir)
    trackers = active_trackers(trainer.args.report_to, trainer.wandb_config)
    notes = getattr(trainer, "tracker_notes", {})
    where = [f"metrics in {folder / 'metrics.jsonl'}"] if "jsonl" in trackers else []
    others = [t + (f" ({notes[t]})" if notes.get(t) else "") for t in trackers if t != "jsonl"]
    where += [f"logged to {', '.join(others)}"] if others else []
    if directory:
        from ..checkpoint.files import list_checkpoints

        found = list_checkpoints(directory)
        newest = f" (newest {found[-1].name})" if found else ""
        _say(f"comlrl: checkpoints in {directory}{newest}" + "".join(f"; {w}" for w in where))
    elif where:
        _say(f"comlrl: {'; '.join(where)}")
    if save_to:
        _say(f"comlrl: agents saved to {save_to}")


# --- export ---------------------------------------------------------------------------------------

def _export_fixed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help="a checkpoint-N directory")
    parser.add_argument("out", nargs="?", metavar="OUT", help="the directory to write agent_0, agent_1, ... into")
    parser.add_argument("--config", metavar="CONFIG.yaml", help="a config of the run (default: the one `comlrl "
                                                                "train` recorded in the checkpoint)")
    parser.add_argument("--merge", action="store_true", help="merge LoRA adapters into plain models (default: "
                                                             "LoRA agents are written as adapter folders)")


_EXPORT_USAGE = "comlrl export CHECKPOINT OUT [--config CONFIG.yaml] [--merge] [--KEY VALUE ...]"


def export(argv: Sequence[str]) -> int:
    """``comlrl export CHECKPOINT OUT [--config CONFIG.yaml] [--merge]``."""
    from ..checkpoint.export import export_checkpoint, exportable
    from ..utils import read_checkpoint_metadata

    ns, doc, entry = parse_run_args(argv, "comlrl export", _EXPORT_USAGE,
                                    "Write a checkpoint's agents as model directories that "
                                    "AutoModelForCausalLM.from_pretrained loads.", _export_fixed,
                                    require_config=False, train_section=False, default_trainer=_recorded_trainer)
    if not ns.checkpoint or not ns.out:
        raise CliError(f"usage: {_EXPORT_USAGE}")
    checkpoint = Path(ns.checkpoint)
    try:
        meta = read_checkpoint_metadata(checkpoint)
    except CheckpointError as exc:
        raise CliError(str(exc)) from None
    if not ns.config and exportable(checkpoint):
        if doc.data:
            raise CliError(f"{checkpoint} holds its model folders, which export copies as they are: flags such as "
                           f"{', '.join(sorted(map(str, doc.data.get('trainer', doc.data))))} have nothing to change. "
                           "Drop them, or pass --config CONFIG.yaml to rebuild the trainer.")
        try:
            folders = export_checkpoint(checkpoint, ns.out, merge=ns.merge)
        except ComlrlError as exc:
            raise CliError(str(exc)) from None
        _say(f"comlrl: exported {checkpoint.name} (epoch {meta['epoch']}, env_step {meta['env_step']}) to "
             f"{ns.out}: {', '.join(folders)}")
        return 0
    if not ns.config:
        doc = recorded_document(checkpoint, meta, doc)
    spec = check_run(doc, entry)
    try:
        trainer = build_trainer(spec, wandb_config=None)  # exporting is not a tracked run
    except ComlrlError as exc:
        raise CliError(locate_error(spec, exc)) from None
    with trainer:
        try:
            trainer._load_for_export(checkpoint)  # the reward etc. need not match: export runs none of them
            out = trainer.save_model(ns.out, merge_adapters=ns.merge)
        except ResumeMismatchError as exc:
            raise CliError(f"{doc.name} does not describe the run of {checkpoint} (export needs the config it was "
                           f"trained with, and the same overrides): {'; '.join(exc.differences)}") from None
        except ComlrlError as exc:
            raise CliError(locate_error(spec, exc)) from None
    folders = sorted(p.name for p in Path(out).iterdir())
    _say(f"comlrl: exported {checkpoint.name} (epoch {meta['epoch']}, env_step {meta['env_step']}) to {out}: "
         f"{', '.join(folders)}")
    return 0


def _recorded_trainer(known: argparse.Namespace) -> Optional[str]:
    """Without ``--config``: the trainer the checkpoint's recorded config names, so that its flags
    are known (an unreadable checkpoint is reported once everything is parsed)."""
    from ..utils import read_checkpoint_metadata

    if known.config or not known.checkpoint:
        return None
    try:
        return recorded_trainer(read_checkpoint_metadata(known.checkpoint))
    except CheckpointError:
        return None


# --- checkpoints ----------------------------------------------------------------------------------

def checkpoints(argv: Sequence[str]) -> int:
    """``comlrl checkpoints DIR``: every checkpoint-N with its counters and whether it verifies."""
    parser = argparse.ArgumentParser(prog="comlrl checkpoints", description="List the checkpoints of a directory "
                                     "and verify every file of each (sizes and sha256).")
    parser.add_argument("directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per checkpoint instead of a table")
    ns = parser.parse_args(argv)
    directory = Path(ns.directory)
    if not directory.is_dir():
        raise CliError(f"{directory} is not a directory.")
    rows = [_checkpoint_row(path) for path in _checkpoint_dirs(directory)]
    from ..utils import find_latest_checkpoint

    latest = find_latest_checkpoint(directory) if rows else None
    if ns.json:
        for row in rows:
            print(json.dumps({**row, "resume_auto": latest is not None and row["path"] == str(latest)}))
        return 0
    if not rows:
        print(f"no checkpoints in {directory}")
        return 0
    table = [["checkpoint", "epoch", "env_step", "step", "run id", "status"]]
    for row in rows:
        epoch = "-" if row["epoch"] is None else str(row["epoch"]) + (
            f" +{row['items_in_epoch']}" if row.get("items_in_epoch") else "")
        table.append([row["name"], epoch, _dash(row["env_step"]), _dash(row["global_step"]),
                      _dash(row["run_id"] and row["run_id"][:12]),
                      "verified" if row["verified"] else f"NOT VERIFIED: {row['problem']}"])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"--resume auto continues from {latest.name}" if latest is not None else
          "--resume auto: no checkpoint verifies, a new run would start")
    return 0


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _checkpoint_dirs(directory: Path) -> list[Path]:
    from ..checkpoint.files import checkpoint_entries

    return [path for path in checkpoint_entries(directory) if path.is_dir() or path.is_symlink()]


def _checkpoint_row(path: Path) -> dict[str, Any]:
    from ..checkpoint.files import looks_like
    from ..checkpoint.legacy import is_legacy_checkpoint
    from ..checkpoint.manager import read_checkpoint
    from ..utils import read_checkpoint_metadata

    row: dict[str, Any] = {"name": path.name, "path": str(path), "epoch": None, "items_in_epoch": None,
                           "env_step": None, "global_step": None, "run_id": None, "verified": False, "problem": None}
    if path.is_symlink():  # find_latest_checkpoint and --resume auto never follow one
        row["problem"] = f"{looks_like(path)}; --resume auto skips it"
        return row
    try:
        meta = read_checkpoint_metadata(path)
        row.update({k: meta.get(k) for k in ("epoch", "items_in_epoch", "env_step", "global_step", "run_id")})
        if is_legacy_checkpoint(path):
            row["problem"] = "written by CoMLRL 1.4.3 (no manifest to verify; train --resume reads it)"
            return row
        read_checkpoint(path)  # every file's size and sha256, every state field
        row["verified"] = True
    except CheckpointError as exc:
        row["problem"] = _one_line(str(exc)).replace(f"checkpoint {path}: ", "").replace(f"{path} ", "")
    return row


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- plot -----------------------------------------------------------------------------------------

_DEFAULT_KEYS = (r"train/reward_mean", r"turn_\d+/reward_mean", r"eval/reward_mean", r"eval/turn_\d+/reward_mean")


def plot(argv: Sequence[str]) -> int:
    """``comlrl plot RUN_DIR``: reward curves from RUN_DIR/metrics.jsonl as a PNG."""
    parser = argparse.ArgumentParser(prog="comlrl plot", description="Plot the reward means of a run "
                                     "(metrics.jsonl) against env_step as a PNG (needs matplotlib, the "
                                     "'plot' extra).")
    parser.add_argument("run_dir", help="a checkpoint_dir / output_dir holding metrics.jsonl (or the file itself)")
    parser.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/reward_curve.png, or with "
                                                    "--key RUN_DIR/metrics_<keys>.png)")
    parser.add_argument("--key", action="append", default=None, metavar="REGEX",
                        help="plot the metrics matching this regular expression instead of the reward means "
                             "(repeatable), e.g. --key 'agent_\\d+/loss'")
    ns = parser.parse_args(argv)
    source = Path(ns.run_dir)
    metrics_file = source if source.is_file() else source / "metrics.jsonl"
    if not metrics_file.is_file():
        raise CliError(f"{metrics_file} does not exist (comlrl plot reads the metrics.jsonl of a checkpoint_dir "
                       "or output_dir).")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(f"comlrl plot needs matplotlib: {install_hint('plot')}.") from None
    try:
        patterns = [re.compile(k) for k in (ns.key or _DEFAULT_KEYS)]
    except re.error as exc:
        raise CliError(f"--key: not a regular expression: {exc}") from None
    series = _series(metrics_file, patterns)
    if not series:
        raise CliError(f"{metrics_file} has no rows with env_step and "
                       f"{' / '.join(ns.key or ['train/reward_mean', 'turn_t/reward_mean'])}.")
    if ns.out:
        out = Path(ns.out)
    elif ns.key:  # never over the reward curve: a name from the keys
        out = metrics_file.parent / f"metrics_{re.sub(r'[^A-Za-z0-9]+', '_', '_'.join(ns.key)).strip('_')[:80]}.png"
    else:
        out = metrics_file.parent / "reward_curve.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 40 else None, markersize=3,
                linestyle="--" if name.startswith("eval/") else "-", label=name)
    ax.set_xlabel("env_step (joint actions scored)")
    ax.set_ylabel("value" if ns.key else "mean reward")
    ax.set_title(metrics_file.parent.name or str(metrics_file))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"comlrl: plotted {', '.join(series)} ({sum(len(p) for p in series.values())} points) to {out}")
    return 0


def _series(metrics_file: Path, patterns: list[re.Pattern]) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(env_step, value), ...]}`` sorted by env_step; a step logged twice (work redone
    after an interruption) keeps its last value."""
    by_key: dict[str, dict[int, float]] = {}
    for number, line in enumerate(metrics_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            print(f"comlrl: {metrics_file.name}:{number}: not JSON, skipped", file=sys.stderr)
            continue
        step = row.get("env_step") if isinstance(row, dict) else None
        if not isinstance(step, (int, float)):
            continue
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
                    any(p.fullmatch(key) for p in patterns):
                by_key.setdefault(key, {})[int(step)] = float(value)
    for prefix in ("", "eval/"):  # one turn: turn_1's curve is the episode's, drawn once
        turns = [k for k in by_key if re.fullmatch(rf"{prefix}turn_\d+/reward_mean", k)]
        whole = "train/reward_mean" if not prefix else "eval/reward_mean"
        if turns == [f"{prefix}turn_1/reward_mean"] and whole in by_key:
            del by_key[turns[0]]
    order = sorted(by_key, key=lambda k: (k.startswith("eval/"), not k.endswith("train/reward_mean"), k))
    return {key: sorted(by_key[key].items()) for key in order}


# --- trainers -------------------------------------------------------------------------------------

def trainers(argv: Sequence[str]) -> int:
    """``comlrl trainers``: the trainers ``trainer.name`` may name."""
    parser = argparse.ArgumentParser(prog="comlrl trainers", description="List the trainers a config can name.")
    parser.parse_args(argv)
    found, failed = available_trainers()
    width = max((len(n) for n in found), default=0)
    for name, entry in sorted(found.items(), key=lambda kv: (kv[1].family, kv[0])):
        print(f"{name.ljust(width)}  {entry.family or '-':<13} {entry.config.__name__:<24} {entry.describe()}")
    for module, why in failed.items():
        print(f"(not available: {module}: {why})", file=sys.stderr)
    return 0
