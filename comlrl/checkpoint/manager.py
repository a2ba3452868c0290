"""The one owner of a run's saved state: the checkpoint directory, writes, pruning and resume.

:class:`CheckpointManager` holds an exclusive OS lock on the checkpoint directory for the whole
run, writes checkpoints on one background thread (a failed write stops training at the next step
boundary, naming the checkpoint), prunes only verified checkpoints of its own run, and loads a
checkpoint back after checking every byte and field it trusts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..exceptions import CheckpointDirError, CheckpointError, ResumeMismatchError
from . import files, sharded
from .fingerprint import compare_fingerprints
from .hyper import check_optimizer_state, check_scheduler_state
from .lock import DirectoryLock
from .rng import capture_rng_state, restore_rng_state
from .state import validate_state

__all__ = ["CheckpointManager", "Slots", "as_checkpoint_error", "latest_checkpoint", "read_checkpoint", "format_version",
           "checkpoint_state"]

logger = logging.getLogger("comlrl")

# Keep the last snapshot's host-memory buffers for the next save up to this size (a fresh copy
# each time page-faults its way in); larger states are copied afresh and released.
REUSE_SNAPSHOT_BYTES = 2 * 2**30


class Slots:
    """The trained state of a run by checkpoint slot: ``modules[slot]``, ``optimizers[slot]``,
    ``schedulers[slot]`` (e.g. ``"agent-0"``; actor-critic runs add ``"critic-0"``, ...), and how
    each module's folder is laid out (``layouts[slot]``, default :data:`files.PLAIN_LAYOUT`)."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], optimizers: Mapping[str, torch.optim.Optimizer],
                 schedulers: Mapping[str, Any], data: Optional[Mapping[str, torch.Tensor]] = None,
                 layouts: Optional[Mapping[str, files.SlotLayout]] = None):
        self.modules, self.optimizers, self.schedulers = dict(modules), dict(optimizers), dict(schedulers)
        self.data = dict(data) if data is not None else None  # a family's tensors (algorithm.safetensors)
        self.layouts = dict(layouts or {})

    def layout(self, slot: str, version: int = files.FORMAT_VERSION) -> files.SlotLayout:
        """How ``slot`` is laid out in a checkpoint of format ``version`` (2: always plain)."""
        return self.layouts.get(slot, files.PLAIN_LAYOUT) if version >= 3 else files.PLAIN_LAYOUT

    def expected_files(self, version: int = files.FORMAT_VERSION) -> set[str]:
        """The files resume reads (side files such as config.json are not among them)."""
        return ({files.RNG_FILE} | {f"{s}/{f}" for s in self.modules for f in self.layout(s, version).files()}
                | {f"{s}/{files.OPTIMIZER_FILE}" for s in self.optimizers}
                | ({files.DATA_FILE} if self.data is not None else set()))


def read_checkpoint(path: str | os.PathLike, expected: Optional[set[str]] = None) -> dict[str, Any]:
    """Verify checkpoint ``path`` (every file's hash; exactly ``expected`` files if given) and
    return its validated state. Anything malformed, however, is a CheckpointError."""
    return _verified(Path(path), expected)[0]


def _verified(path: Path, expected: Optional[set[str]] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, manifest)`` of checkpoint ``path``, both from one reading of its manifest."""
    with as_checkpoint_error(path):
        manifest = files.verify(path, expected)
        return validate_state(files.read_state(path, manifest), path, manifest["checkpoint"]), manifest


@contextlib.contextmanager
def as_checkpoint_error(path: Path) -> Iterator[None]:
    """Turn any error reading a hostile checkpoint (an odd path in its manifest, a value of the
    wrong type deep inside, a file that vanished) into a CheckpointError naming it."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path} is malformed ({type(exc).__name__}: {exc}).") from None


def format_version(path: str | os.PathLike) -> int:
    """The format version of checkpoint ``path`` (its manifest's, checked against its hash)."""
    return files.read_manifest(path)["format_version"]


def latest_checkpoint(directory: str | os.PathLike, run_id: Optional[str] = None) -> Optional[Path]:
    """The newest checkpoint in ``directory`` that verifies (of run ``run_id`` if given), or None:
    a damaged, tampered or foreign newest entry (a symbolic link, a folder without a manifest) is
    skipped, with a warning naming it, for the one before it."""
    for path in reversed(files.checkpoint_entries(directory)):
        if not files.is_committed(path):
            what = files.looks_like(path)
            hint = " (continue it by passing its path as resume_from_checkpoint)" if "1.4.3" in what else ""
            logger.warning("comlrl: skipping %s: %s, not a comlrl checkpoint%s", path, what, hint)
            continue
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("comlrl: skipping %s: %s", path, exc)
            continue
        if run_id is None or state["run_id"] == run_id:
            return path
    return None


def checkpoint_state(path: str | os.PathLike) -> dict[str, Any]:
    """The validated state of checkpoint ``path`` from its manifest and state file alone (no
    tensor file is hashed): quick, for decisions before a full :meth:`CheckpointManager.load`."""
    path = Path(path)
    with as_checkpoint_error(path):
        return validate_state(files.read_state(path), path, files.read_manifest(path)["checkpoint"])


def _state_of(path: Path) -> Optional[dict[str, Any]]:
    """:func:`checkpoint_state`, or None if it does not verify."""
    try:
        return checkpoint_state(path)
    except CheckpointError:
        return None


def _checked_optimizer_states(path: Path, state: dict[str, Any], slots: Slots,
                              manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every slot's optimizer state, read and checked with its scheduler's against the live ones
    (:mod:`comlrl.checkpoint.hyper`); nothing is loaded yet. A sharded module's optimizer reads only
    this process's part of each moment (a collective)."""
    for slot, scheduler in slots.schedulers.items():
        check_scheduler_state(path, slot, scheduler, state["schedulers"][slot])
    out = {}
    for slot, optimizer in slots.optimizers.items():
        module = slots.modules.get(slot)
        if module is not None and sharded.is_sharded_module(module):
            out[slot] = sharded.load_sharded_optimizer(path, slot, optimizer, state["optimizers"][slot])
        else:
            out[slot] = files.read_optimizer(path, slot, state["optimizers"][slot], manifest)
        check_optimizer_state(path, slot, optimizer, out[slot], state["schedulers"].get(slot)
                              if slot in slots.schedulers else None)
    return out


def _check_step_counter(path: Path, state: dict[str, Any]) -> None:
    """``global_step`` counts the agents' optimizer steps, and each agent's schedule steps once
    per optimizer step (a skipped step moves neither): a counter that disagrees with the schedules
    (checked against their own rates already) was edited."""
    steps = {slot: saved["last_epoch"] for slot, saved in state["schedulers"].items() if slot.startswith("agent-")}
    global_step = state["counters"]["global_step"]
    if steps and max(steps.values()) != global_step:
        raise CheckpointError(f"checkpoint {path}: global_step is {global_step}, while its agents' schedules took "
                              f"{max(steps.values())} optimizer steps ({steps}); the counters were edited. Resume from "
                              "another checkpoint.")


def _refuse_foreign(directory: Path, resumed_number: Optional[int]) -> None:
    """Refuse a directory holding ``checkpoint-N`` entries this run did not write (they are never
    deleted or replaced): any, for a fresh run; for a resumed one, those it would write over
    (numbers above the checkpoint resumed from). A CoMLRL 1.4.3 checkpoint resumed from in its own
    directory, and older ones beside it, stay where they are, untouched."""
    for path, what in files.foreign_checkpoints(directory):
        if resumed_number is None:
            raise CheckpointDirError(
                f"{directory} holds {path.name}, {what}, which this run did not write; nothing was touched. A fresh "
                "run needs a checkpoint_dir without checkpoint-N entries of others: use an empty checkpoint_dir or "
                f"move {path.name} away (to continue a CoMLRL 1.4.3 run, pass its checkpoint as "
                "resume_from_checkpoint).")
        if files.checkpoint_number(path) > resumed_number:
            raise CheckpointDirError(
                f"{directory} holds {path.name}, {what}; resuming from checkpoint-{resumed_number} would later write "
                f"a {path.name} of its own there, and comlrl never replaces what a run did not write. Nothing was "
                f"touched: move {path.name} away or use another checkpoint_dir.")


def _refuse_replacing(path: Path, run_id: str) -> None:
    """``path`` (a checkpoint about to be written) may be replaced only when it is a checkpoint of
    this run whose manifest and state verify."""
    if not os.path.lexists(path):
        return
    state = _state_of(path) if path.is_dir() and not path.is_symlink() else None
    if state is None or state["run_id"] != run_id:
        owner = ("not a checkpoint of this run (another run's)" if state is not None
                 else "not a checkpoint (or one that does not verify)")
        raise CheckpointDirError(f"{path} exists and is {owner}; comlrl never replaces what this run did not write, "
                                 "and nothing was written. Move it away or choose another directory.")


class CheckpointManager:
    """Checkpoints of one run in one directory.

    Args:
        is_main: whether this process writes (rank 0 under torchrun; the others only take part
            in :meth:`capture` and :meth:`load`).
    """

    def __init__(self, is_main: bool = True):
        self.is_main = is_main
        self.directory: Optional[Path] = None
        self._lock: Optional[DirectoryLock] = None
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple[int, Future]] = None
        self._last: Optional[files.Snapshot] = None

    # --- the directory ----------------------------------------------------------------------
    def open(self, directory: str | os.PathLike, run_id: str, resumed_number: Optional[int]) -> None:
        """Take ``directory`` for this run: lock it, refuse another run's checkpoints, remove what
        an interrupted earlier attempt of this run left (temporary files, checkpoints newer than
        the one resumed from, which training redoes)."""
        directory = Path(directory)
        if self.directory == directory.resolve():
            return
        if self.directory is not None:
            self.release()
        if self.is_main:
            self._lock = DirectoryLock(directory)
            try:
                self._claim(directory, run_id, resumed_number)
            except BaseException:
                self._lock.release()
                self._lock = None
                raise
        self.directory = directory.resolve()

    def _claim(self, directory: Path, run_id: str, resumed_number: Optional[int]) -> None:
        _refuse_foreign(directory, resumed_number)
        newer = []
        for existing in files.list_checkpoints(directory):
            state = _state_of(existing)
            if state is None or state["run_id"] != run_id:
                what = (f"of another run (run id {state['run_id'][:12]}; this train() starts a new one)" if state
                        else "which does not verify")
                raise CheckpointDirError(
                    f"{directory} already holds {existing.name}, {what}; nothing was touched. To continue that run, "
                    "resume from its newest checkpoint (resume_from_checkpoint=...); to start over, use an empty "
                    "checkpoint_dir.")
            if resumed_number is not None and files.checkpoint_number(existing) > resumed_number:
                newer.append(existing)
        if newer:
            logger.warning("comlrl: resuming from checkpoint-%d; removing the newer %s of the same run (training "
                           "redoes them)", resumed_number, ", ".join(p.name for p in newer))
            files.remove_checkpoints(newer)
        for stale in list(directory.glob(".tmp-checkpoint-*")) + list(directory.glob(".old-checkpoint-*")):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)  # leftovers of an interrupted save or prune

    def release(self) -> None:
        """Wait for the pending write, then unlock the directory."""
        try:
            self.wait()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            self.directory = None

    # --- saving -------------------------------------------------------------------------------
    def save(self, number: int, record: dict[str, Any], slots: Slots,
             rng_states: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]], limit: Optional[int],
             run_id: str) -> Path:
        """Copy the state now and write ``checkpoint-number`` on the writer thread (rank 0).

        ``rng_states``: every process's :func:`capture_rng_state`, in rank order.
        """
        assert self.directory is not None, "open() the checkpoint directory first"
        path = files.checkpoint_path(self.directory, number)
        if not self.is_main:
            return path
        self.wait()  # checkpoints commit in order; an earlier failure surfaces here
        _refuse_replacing(path, run_id)
        snap = self._snapshot(number, record, slots, rng_states)
        self._last = snap if snap.nbytes() <= REUSE_SNAPSHOT_BYTES else None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comlrl-checkpoint")
        self._pending = (number, self._writer.submit(self._write, snap, limit, run_id))
        return path

    def _snapshot(self, number: int, record: dict[str, Any], slots: Slots,
                  rng_states: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]],
                  prewritten: frozenset[str] = frozenset()) -> files.Snapshot:
        record = dict(record, world_size=len(rng_states), rng=rng_states[0][0],
                      rng_other_ranks=[json_part for json_part, _ in rng_states[1:]],
                      schedulers={slot: s.state_dict() for slot, s in slots.schedulers.items()})
        rng_tensors = dict(rng_states[0][1])
        for rank, (_, tensors) in enumerate(rng_states[1:], start=1):
            rng_tensors.update({f"rank{rank}/{k}": v for k, v in tensors.items()})
        return files.snapshot(number, record, slots.modules, slots.optimizers, rng_tensors,
                              reuse=self._last if self._pending is None and not prewritten else None, data=slots.data,
                              layouts=slots.layouts, prewritten=prewritten)

    def save_sharded(self, number: int, record: dict[str, Any], slots: Slots,
                     rng_states: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]], limit: Optional[int],
                     run_id: str, begin: Callable[[Callable[[], Path]], Path],
                     finish: Callable[[Callable[[], Path]], Path]) -> Path:
        """Save ``checkpoint-number`` of a run with sharded modules, synchronously: every process
        writes its shards (:mod:`comlrl.checkpoint.sharded`) into a temporary directory rank 0
        made, then rank 0 writes the rest and commits it as :meth:`save` does. ``begin`` /
        ``finish`` run a function on rank 0 and hand its result (or error) to every process."""
        tmp = begin(lambda: (self.wait(), files.temporary_checkpoint_dir(self.directory, number))[1])
        try:
            for slot, module in slots.modules.items():
                if sharded.is_sharded_module(module):
                    sharded.save_sharded_slot(tmp / slot, module, slots.optimizers.get(slot),
                                              slots.layout(slot).files()[0], self.is_main)
        except BaseException:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        prewritten = frozenset(s for s, m in slots.modules.items() if sharded.is_sharded_module(m))

        def commit() -> Path:
            snap = self._snapshot(number, record, slots, rng_states, prewritten)
            path = files.write_checkpoint(self.directory, snap, prewritten=tmp)
            if limit is not None:
                self._prune(limit, run_id, keep=path)
            logger.info("comlrl: saved %s (env_step %s)", path, snap.record["counters"]["env_step"])
            return path
        return finish(commit)

    def write_named(self, target: Path, number: int, record: dict[str, Any], slots: Slots,
                    rng_states: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> Path:
        """Write a checkpoint now, synchronously, under any directory name (``save_checkpoint``)."""
        target = Path(target)
        _refuse_replacing(target, record["run_id"])
        snap = self._snapshot(number, record, slots, rng_states)
        return files.write_checkpoint(target.parent, snap, name=target.name)

    def _write(self, snap: files.Snapshot, limit: Optional[int], run_id: str) -> Path:
        """The slow half of a save, on the writer thread: files, fsync, rename, pruning."""
        path = files.write_checkpoint(self.directory, snap)
        if limit is not None:
            self._prune(limit, run_id, keep=path)
        logger.info("comlrl: saved %s (env_step %s)", path, snap.record["counters"]["env_step"])
        return path

    def _prune(self, limit: int, run_id: str, keep: Path) -> None:
        """Delete all but the newest ``limit`` checkpoints of this run, judged by verified state."""
        mine = [p for p in files.list_checkpoints(self.directory)
                if p != keep and (state := _state_of(p)) is not None and state["run_id"] == run_id]
        doomed = mine[: max(0, len(mine) - (limit - 1))]
        files.remove_checkpoints(doomed)

    def _collect(self) -> Optional[CheckpointError]:
        number, future = self._pending  # type: ignore[misc]
        self._pending = None
        exc = future.exception()
        if exc is None:
            return None
        error = CheckpointError(f"writing checkpoint-{number} in {self.directory} failed: {type(exc).__name__}: "
                                f"{exc}. The previous checkpoint is intact; free space (a save needs about the "
                                "size of one checkpoint, temporarily twice when re-saving a number) and resume.")
        error.__cause__ = exc
        return error

    def wait(self) -> None:
        """Block until the pending write (if any) is committed; raise its error."""
        if self._pending is None:
            return
        wait_for([self._pending[1]])  # Ctrl-C here leaves the write pending, drained by close()
        error = self._collect()
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the pending write, stop the writer thread and unlock the directory."""
        try:
            self.release()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self._last = None

    # --- resuming -------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, slots: Slots, fingerprints: Mapping[str, Any],
             saved_fingerprints: Callable[[dict[str, Any]], dict[str, Any]] = lambda s: s["fingerprints"],
             rank: int = 0) -> dict[str, Any]:
        """Verify ``path``, check that it belongs to a run set up like this one, and load every
        slot, the schedulers and this process's random states. Returns the validated state.

        Every file is read once more as it is deserialized and its bytes checked against the one
        manifest read here: a file replaced after the verification (another checkpoint's weights
        or optimizer swapped in) is refused, never loaded."""
        path = Path(path)
        state, manifest = _verified(path)
        differences = compare_fingerprints(saved_fingerprints(state), dict(fingerprints))
        if differences:
            raise ResumeMismatchError(str(path), differences)
        version = manifest["format_version"]
        files.verify_listing(path, slots.expected_files(version), manifest,
                             side_folders=slots.modules if version >= 3 else ())
        if set(state["optimizers"]) != set(slots.optimizers) or set(state["schedulers"]) != set(slots.schedulers):
            raise CheckpointError(f"checkpoint {path}: its optimizer / scheduler slots "
                                  f"{sorted(state['optimizers'])} do not match this trainer's {sorted(slots.optimizers)}.")
        optimizer_states = _checked_optimizer_states(path, state, slots, manifest)  # before live state changes
        _check_step_counter(path, state)
        rng_tensors = files.load_tensors(path, files.RNG_FILE, manifest)
        if slots.data is not None:
            state["data"] = files.load_tensors(path, files.DATA_FILE, manifest)
        for slot, module in slots.modules.items():
            if sharded.is_sharded_module(module):
                sharded.load_sharded_module(path, slot, module)
            else:
                files.load_module(path, slot, module, slots.layout(slot, version), manifest)
        for slot, optimizer in slots.optimizers.items():
            files.load_optimizer(path, slot, optimizer, optimizer_states[slot])
        for slot, scheduler in slots.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][slot])
        self._restore_rng(path, state, rank, rng_tensors)
        return state

    @staticmethod
    def _restore_rng(path: Path, state: dict[str, Any], rank: int, tensors: dict[str, torch.Tensor]) -> None:
        try:
            if 0 < rank < state["world_size"]:
                prefix = f"rank{rank}/"
                restore_rng_state(state["rng_other_ranks"][rank - 1],
                                  {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            else:
                restore_rng_state(state["rng"], {k: v for k, v in tensors.items() if "/" not in k})
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {path}: its random states are malformed ({type(exc).__name__}: "
                                  f"{exc}).") from None

    @staticmethod
    def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return capture_rng_state()
