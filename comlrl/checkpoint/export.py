"""Model folders out of a checkpoint, from the checkpoint alone; and the export directory rule.

Since format 3 every trained module's folder of a checkpoint is already what ``from_pretrained``,
PEFT or ``CausalLMWithValueHead.from_pretrained`` loads (:mod:`comlrl.engine.layouts`), and the
checkpoint records where ``save_model`` puts each one (``folders``: ``agent-0`` -> ``agent_0``, an
IAC critic -> ``agent_0/critic``). :func:`export_checkpoint` therefore needs no trainer, no config
and no reward: it verifies the checkpoint, copies each folder's files except the optimizer state,
and with ``merge=True`` merges LoRA adapters into their base (which must be the run's, checked by
fingerprint).

An export directory is only ever replaced when comlrl wrote it: :func:`write_export` leaves
:data:`MARKER` listing what it wrote, and refuses a directory holding anything else (the user's
own ``agent_0/``, a run directory, ``.``).
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from .._io import atomic_write_text, fsync_dir, fsync_tree, refuse_link
from .._imports import install_hint
from ..exceptions import CheckpointError, ConfigError
from . import files
from .state import validate_state

__all__ = ["export_checkpoint", "write_export", "check_export_target", "export_record", "MARKER", "exportable"]

MARKER = ".comlrl-export.json"  # in an export folder: what the export wrote, from where, for which run
_SKIPPED = {files.OPTIMIZER_FILE}  # training state, not part of a model folder
_ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def exportable(path: str | os.PathLike) -> bool:
    """Whether checkpoint ``path`` records its export folders (written by this comlrl or later)."""
    from .manager import checkpoint_state

    try:
        return bool(checkpoint_state(path)["folders"])
    except CheckpointError:
        return False


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, merge: bool = False,
                      base_loader: Optional[Callable[[str], Any]] = None) -> list[str]:
    """Write every exported module of ``checkpoint`` as a model folder under ``out`` (``agent_0``,
    ``agent_1``, ..., critics where the trainer's ``save_model`` puts them) and return the folder
    names.

    Args:
        checkpoint: a ``checkpoint-N`` directory written by comlrl (format 3 or later).
        out: the export directory: new, empty, or an earlier export (see :func:`write_export`).
        merge: LoRA agents as plain models (the adapter merged into its base) instead of PEFT
            adapter folders. The base is loaded from the adapter's ``base_model_name_or_path``
            (``base_loader(name)``, default ``AutoModelForCausalLM.from_pretrained``) and must be
            the run's base (its fingerprint is checked).
    Raises:
        CheckpointError: the checkpoint does not verify, or predates recorded export folders (use
            ``comlrl export --config`` / ``trainer.save_model`` for those).
        ConfigError: ``out`` holds files export did not write, or a merge's base is not the run's.
    """
    from .manager import as_checkpoint_error

    source = Path(checkpoint)
    with as_checkpoint_error(source):  # a checkpoint pruned meanwhile: a CheckpointError, not a traceback
        manifest = files.verify(source)
        state = validate_state(files.read_state(source, manifest), source, manifest["checkpoint"])
    folders = state["folders"]
    if not folders:
        raise CheckpointError(f"{source} does not record its export folders (written before comlrl stored them); "
                              "export it with `comlrl export CHECKPOINT OUT --config CONFIG.yaml` or "
                              "trainer.load_checkpoint(...) + trainer.save_model(OUT).")
    listed = manifest["files"]

    def fill(tmp: Path) -> None:
        for slot, folder in sorted(folders.items(), key=lambda item: item[1].count("/")):  # parents first
            names = sorted(rel.split("/", 1)[1] for rel in listed if rel.startswith(slot + "/"))
            target = tmp / folder
            target.mkdir(parents=True, exist_ok=True)
            for name in names:
                if name not in _SKIPPED:
                    _copy_verified(source / slot / name, target / name, listed[f"{slot}/{name}"])
            if merge and _ADAPTER_FILES <= set(names):
                _merge_adapter(target, slot, state["fingerprints"], base_loader)

    return write_export(Path(out), fill, origin=str(source.resolve()), run_id=state["run_id"])


def _copy_verified(src: Path, dst: Path, info: dict[str, Any]) -> None:
    """Copy ``src`` and check the copy's bytes against the manifest (the source may change
    between the verification and the copy)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile(src, dst, follow_symlinks=False)
    except FileNotFoundError:
        if os.path.lexists(src):
            raise
        raise CheckpointError(f"{src} disappeared while it was exported (a running training pruning its checkpoints, "
                              "checkpoint_total_limit?); nothing was written. Export a checkpoint the run keeps, or "
                              "after the run.") from None
    digest = hashlib.sha256()
    with open(dst, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    if dst.stat().st_size != info["bytes"] or digest.hexdigest() != info["sha256"]:
        raise CheckpointError(f"{src} changed while it was exported (its sha256 no longer matches the manifest); "
                              "nothing was written.")


def _merge_adapter(folder: Path, slot: str, fingerprints: dict[str, Any],
                   base_loader: Optional[Callable[[str], Any]]) -> None:
    """Replace a PEFT adapter folder by the plain model it makes with its base."""
    from .fingerprint import base_fingerprint

    try:
        import peft
    except ImportError:
        raise ConfigError(f"merging a LoRA agent needs peft: {install_hint('peft')} (or export without "
                          "--merge: the adapter folder needs no peft to be written).") from None
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    name = config.get("base_model_name_or_path")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{slot}: its adapter_config.json names no base model, so --merge cannot find it; export "
                          "the adapter folder (without --merge) and merge it with PEFT yourself.")
    if base_loader is None:
        from transformers import AutoModelForCausalLM

        def base_loader(base_name: str) -> Any:
            return AutoModelForCausalLM.from_pretrained(base_name, trust_remote_code=False)

    base = base_loader(name)
    expected = _base_record(fingerprints, slot)
    if expected is not None and base_fingerprint(base) != expected:
        raise ConfigError(f"{slot}: the base model at {name!r} is not the one the run trained on (its fingerprint "
                          "differs); --merge needs the run's base. Export without --merge to get the adapter.")
    merged = peft.PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    for adapter_file in _ADAPTER_FILES:
        (folder / adapter_file).unlink()
    merged.save_pretrained(folder)


def _base_record(fingerprints: dict[str, Any], slot: str) -> Optional[dict[str, Any]]:
    """The recorded fingerprint of the base of LoRA agent ``agent-i`` (None for other slots)."""
    bases = fingerprints.get("lora_bases") or (fingerprints.get("online") or {}).get("lora_bases")
    kind, _, index = slot.rpartition("-")
    if kind != "agent" or not isinstance(bases, list) or not index.isdigit() or int(index) >= len(bases):
        return None
    return bases[int(index)]


# --- the export directory -----------------------------------------------------------------------

_FOLDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")  # agent_0, critic: one plain segment
_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}$")  # one segment of a file listed (no '.', '..')


def _plain_folder(name: Any) -> bool:
    """Whether ``name`` is what an export writes at its top level: one plain folder name
    (``agent_0``, ``critic``), never a path, ``..`` or an absolute path."""
    return isinstance(name, str) and bool(_FOLDER_NAME.match(name))


def _plain_file(rel: Any) -> bool:
    """Whether ``rel`` is a relative file path inside one of an export's folders."""
    if not isinstance(rel, str) or len(rel) > 1024:
        return False
    parts = rel.split("/")
    return len(parts) >= 2 and _plain_folder(parts[0]) and all(_FILE_NAME.match(p) for p in parts[1:])


def export_record(target: Path) -> Optional[dict[str, Any]]:
    """What an earlier export wrote into ``target`` (``{"folders", "files", "run_id", "source",
    "complete"}`` from its :data:`MARKER`), or None when ``target`` holds no valid record.

    A marker is read as data anyone could have written: only plain top-level folder names
    (``agent_0``) and relative files inside them are accepted, so a forged ``"../victim"`` or an
    absolute path can never make an export delete anything outside ``target``. ``complete`` is
    False while (or after a crash while) an export replaces an earlier one: its folders may then
    come from two checkpoints."""
    try:
        record = json.loads((Path(target) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    folders, listed, run_id = record.get("folders"), record.get("files"), record.get("run_id")
    complete = record.get("complete", True)
    if not (isinstance(folders, list) and all(_plain_folder(f) for f in folders) and isinstance(listed, list)
            and all(_plain_file(f) and f.split("/", 1)[0] in folders for f in listed)
            and (run_id is None or isinstance(run_id, str)) and isinstance(complete, bool)):
        return None
    return {"folders": folders, "files": listed, "run_id": run_id, "source": record.get("source"),
            "complete": complete}


def _inside(target: Path, name: str) -> Path:
    """``target/name`` for a top-level export folder, checked to be a real directory entry of
    ``target`` itself (not a link, not elsewhere once resolved)."""
    path = target / name
    if not _plain_folder(name) or path.is_symlink() or path.resolve().parent != target.resolve():
        raise ConfigError(f"{target}: the export folder {name!r} is not a plain folder inside the export directory; "
                          "nothing of it was removed.")
    return path


_TMP = ".tmp-export-"  # an interrupted export's scratch folder inside its target: removed, never counted


def _present(target: Path) -> set[str]:
    """Every file (and link) below ``target``, as relative paths; not the marker itself, nor an
    export's scratch folder."""
    return {rel for p in target.rglob("*") if (not p.is_dir() or p.is_symlink())
            and not (rel := p.relative_to(target).as_posix()).startswith(_TMP)} - {MARKER}


def _earlier_export(target: Path) -> Optional[dict[str, Any]]:
    """None for a new ``target``; the record of an earlier export (empty for an empty directory)
    when that is all ``target`` holds; else a ConfigError naming what is in the way. Only the
    top level and the recorded folders are looked at: a large folder of the user's is refused at
    its first entry, never walked."""
    refuse_link(target, "the export directory", ConfigError)
    if not target.exists():
        return None
    if not target.is_dir():
        raise ConfigError(f"{target} exists and is not a directory; nothing was written. Choose a new directory for "
                          "the export.")
    recorded = export_record(target)
    record = recorded or {"folders": [], "files": [], "run_id": None}
    allowed = set(record["folders"]) | {MARKER}
    foreign = list(itertools.islice((p.name for p in target.iterdir()
                                     if p.name not in allowed and not p.name.startswith(_TMP)), 6))
    if not foreign:
        listed = set(record["files"])
        foreign = list(itertools.islice((rel for name in record["folders"] if (target / name).is_dir()
                                         and not (target / name).is_symlink()
                                         for rel in sorted(f"{name}/{r}" for r in _present(target / name))
                                         if rel not in listed), 6))
        foreign += [name for name in record["folders"] if (target / name).is_symlink()][:1]
    if foreign:
        raise ConfigError(f"{target} already holds files export did not write ({', '.join(sorted(foreign)[:5])}"
                          f"{', ...' if len(foreign) > 5 else ''}); nothing was written or removed. Choose a new or "
                          "empty directory.")
    return record


def _scratch(parent: Path, target: Path) -> Path:
    """A new scratch folder for an export of ``target`` in ``parent``, named after the target and
    this process (``.tmp-export-<name>-<pid>-<hex>``); those a killed export left there (its
    process gone) are removed first."""
    prefix = f"{_TMP}{target.name}-" if parent != target else _TMP
    for leftover in parent.glob(f"{glob.escape(prefix)}*"):
        pid = leftover.name[len(prefix):].split("-")[0]
        if leftover.is_dir() and not leftover.is_symlink() and (parent == target or not _alive(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a scratch folder's writer) still runs; unknown counts as alive."""
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def check_export_target(target: Path) -> None:
    """Refuse an export directory that holds anything comlrl did not write there."""
    _earlier_export(Path(target))


def write_export(target: Path, fill: Callable[[Path], None], origin: str, run_id: Optional[str] = None) -> list[str]:
    """Write an export (``fill(folder)`` writes its top-level folders, e.g. ``agent_0``) to
    ``target`` and record what it holds in :data:`MARKER`; returns the folders written.

    ``target`` must be new, an empty directory, or an earlier export untouched since (anything else,
    such as the user's own ``agent_0/`` or a run directory, is refused and nothing is written). A new
    ``target`` appears whole or not at all. Into an existing one (the working directory, say) the
    folders are swapped one by one under a marker that says ``"complete": false`` and names both
    exports, rewritten as complete only after the last swap: a crash in between never leaves agents
    of two checkpoints under a marker naming one. Replaced folders go into the export's scratch
    folder, which the next export removes.
    """
    target = Path(target)
    earlier = _earlier_export(target)
    parent = target if earlier is not None else target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = _scratch(parent, target)
    try:
        return _swap_in(target, tmp, earlier, fill, origin, run_id)
    except OSError as exc:  # a full disk, a folder that vanished: a clear error, not a traceback
        kept = ("nothing was written" if earlier is None else
                f"{target} holds the earlier export, or one its marker calls incomplete, which the next export replaces")
        raise CheckpointError(f"writing the export to {target} failed: {exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename else ''}; {kept}. Free space (an export needs "
                              "the size of its models beside the target) and export again.") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(target: Path, tmp: Path, earlier: Optional[dict[str, Any]], fill: Callable[[Path], None], origin: str,
             run_id: Optional[str]) -> list[str]:
    """Fill ``tmp`` and put it in place as ``target`` (see :func:`write_export`)."""
    fill(tmp)
    folders = sorted(p.name for p in tmp.iterdir())
    bad = [name for name in folders if not _plain_folder(name)]
    if bad:
        raise ConfigError(f"an export writes plain top-level folders (agent_0, critic), not {bad[:3]}; nothing "
                          "was written.")
    fsync_tree(tmp)
    if earlier is None:
        _write_marker(tmp, folders, _present(tmp), origin, run_id)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return folders
    _earlier_export(target)  # again: nothing of the user's appeared meanwhile
    stale = [f for f in earlier["folders"] if f not in folders]
    new_files = {f"{name}/{rel}" for name in folders for rel in _present(tmp / name)} | {
        rel for rel in earlier["files"] if rel.split("/", 1)[0] in stale}
    _write_marker(target, sorted(set(earlier["folders"]) | set(folders)), new_files | set(earlier["files"]),
                  origin, run_id, replacing=earlier.get("source"))  # a crash below leaves nothing unlisted
    replaced = tmp / "replaced"
    replaced.mkdir()
    for name in folders:
        if os.path.lexists(target / name):
            os.rename(_inside(target, name), replaced / name)
        os.rename(tmp / name, target / name)
    for name in stale:
        if os.path.lexists(target / name):
            os.rename(_inside(target, name), replaced / name)
    fsync_dir(target)
    _write_marker(target, folders, {f for f in new_files if f.split("/", 1)[0] in folders}, origin, run_id)
    return folders


def _write_marker(folder: Path, folders: list[str], files_written: set[str], origin: str,
                  run_id: Optional[str], replacing: Any = False) -> None:
    """Write :data:`MARKER`; ``replacing`` (the earlier export's source, or None when it named
    none) marks the export incomplete: its folders are being swapped."""
    record = {"written_by": "comlrl", "source": origin, "run_id": run_id, "folders": folders,
              "files": sorted(files_written), "complete": replacing is False}
    if replacing is not False:
        record["replacing"] = replacing
    atomic_write_text(folder / MARKER, json.dumps(record, indent=1))
