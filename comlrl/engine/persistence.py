"""What a trainer saves and loads: checkpoints through :class:`comlrl.checkpoint.CheckpointManager`
(its fingerprints, record and resume, also from CoMLRL 1.4.3) and ``save_model`` exports."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .._version import __version__
from ..checkpoint.export import write_export
from ..checkpoint.fingerprint import callable_fingerprint, compare_fingerprints, model_fingerprint, tokenizer_fingerprint
from ..checkpoint.manager import CheckpointManager, Slots, checkpoint_state
from ..checkpoint.state import RunRecord
from ..exceptions import ConfigError, ResumeMismatchError, TrainingError
from . import distributed as dist
from .config import field_defaults, resumable_fields
from .layouts import module_layout, slot_index
from .state import TrainState

__all__ = ["Persistence", "write_agents"]

logger = logging.getLogger("comlrl")

# Fingerprints of what decides how a run trains, not what its checkpoint's weights are: an export
# checks the rest (models, tokenizers, agents, LoRA, critics); the slots' files check the layout.
_TRAINING_ONLY = ("reward_func", "reward_processor", "formatters", "external_transition", "config", "dataset")


class Persistence:
    """Checkpoint and export methods of :class:`comlrl.engine.trainer.Trainer`."""

    #: How the run was launched, kept in its checkpoints: ``comlrl train`` sets
    #: ``{"config_file", "config": {"trainer": {...}}, "cwd"}`` (:func:`comlrl.cli.launch.launch_record`)
    #: so that ``comlrl export`` can rebuild the trainer without the config file. Never read by training.
    launch_config: Optional[dict[str, Any]] = None
    _code_cache: Optional[tuple[list, dict[str, Any]]] = None

    def _fingerprints(self) -> dict[str, Any]:
        """What a resumed run must share with this one (computed once: hashing a large tokenizer or
        dataset at every save would cost more than the save)."""
        if self._fingerprint_cache is None:
            tokenizers = {id(t): tokenizer_fingerprint(t) for t in {id(t): t for t in self.tokenizers}.values()}
            fixed = resumable_fields(type(self.args))
            self._fingerprint_cache = {
                "trainer": type(self).__name__,
                "config": {k: v for k, v in self.args.to_dict().items() if k not in fixed},
                "num_agents": self.num_agents,
                "models": [model_fingerprint(m) for m in self.agents],
                "tokenizers": [tokenizers[id(t)] for t in self.tokenizers],
                "dataset": self._table("train").fingerprint,
                **self._code_fingerprints(),
                **self.fingerprint_extra(),
            }
        fingerprints = dict(self._fingerprint_cache)
        fixed = resumable_fields(type(self.args))  # the config may be edited between train() calls
        fingerprints["config"] = {k: v for k, v in self.args.to_dict().items() if k not in fixed}
        return fingerprints

    def _code_fingerprints(self) -> dict[str, Any]:
        """Fingerprints of the run's functions, taken when they are first seen (at construction,
        again only if one is replaced): a value a function fills as it runs, such as a memo cache,
        must not make its own run look changed at resume."""
        functions = {"reward_func": self.reward_func, "reward_processor": self.reward_processor,
                     "external_transition": self.external_transition if self.transition else None}
        formatters = [f.source for f in self.formatters]
        held = [*functions.values(), *formatters]  # kept alive in the cache, so their ids stay theirs
        if self._code_cache is None or list(map(id, self._code_cache[0])) != list(map(id, held)):
            self._code_cache = (held, {**{name: callable_fingerprint(f) for name, f in functions.items()},
                                       "formatters": [callable_fingerprint(f) for f in formatters]})
        return self._code_cache[1]

    def _record(self) -> dict[str, Any]:
        """The JSON state of a checkpoint (the manager adds RNG and optimizer state)."""
        return RunRecord(run_id=self.run_id, trainer=type(self).__name__, counters=self.state.counters(),
                         log_window=self.state.window.to_dict(), num_train_epochs=self.args.num_train_epochs,
                         wandb=self.wandb_identity, trackers=dict(self.tracker_identities), config=self.args.to_dict(),
                         fingerprints=self._fingerprints(), comlrl_version=__version__, launch=self.launch_config,
                         algorithm=self.algorithm_state(), folders=self._export_folders()).to_json()

    def _export_folders(self) -> dict[str, str]:
        """``{slot: folder}``: where ``save_model`` puts each exported module (``agent-0`` ->
        ``agent_0``, an IAC critic ``critic-0`` -> ``agent_0/critic``), kept in every checkpoint so
        that ``comlrl export`` needs nothing but the checkpoint."""
        by_module = {id(m): slot for slot, m in self.trained_slots().modules.items()}
        return {by_module[id(m)]: folder for folder, m, _ in self._exported() if id(m) in by_module}

    def _saved_slots(self) -> Slots:
        """:meth:`_slots` with each module's folder layout (:mod:`comlrl.engine.layouts`); side
        files are built once per module and kept with it."""
        slots = self.trained_slots()
        for slot, module in slots.modules.items():
            slots.layouts[slot] = self._layout(slot, module)
        return slots

    def _layout(self, slot: str, module: torch.nn.Module) -> Any:
        """``module``'s folder layout in slot ``slot`` (built once; the module is kept alive beside
        it, so its id stays its own)."""
        cache = self.__dict__.setdefault("_layout_cache", {})
        if (slot, id(module)) not in cache:
            cache[(slot, id(module))] = (module, module_layout(module, self._slot_tokenizer(slot)))
        return cache[(slot, id(module))][1]

    def _slot_tokenizer(self, slot: str) -> Any:
        """The tokenizer saved in a slot's folder: agent i's for ``<kind>-i``, else the first agent's."""
        index = slot_index(slot)
        return self.tokenizers[index] if index is not None and index < len(self.tokenizers) else self.tokenizers[0]

    def algorithm_state(self) -> dict[str, Any]:
        """Family-specific JSON state to save (e.g. a phase of a multi-phase algorithm)."""
        return {}

    def load_algorithm_state(self, state: dict[str, Any], tensors: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Restore what :meth:`algorithm_state` saved (and the family's tensors, see
        :meth:`comlrl.engine.trainer.Trainer._slots`)."""

    def save_run_checkpoint(self, number: int, limit: Optional[int]) -> Path:
        """Save checkpoint ``number`` (the files are written on the manager's thread)."""
        self._check_finite_weights(number)
        self.state.checkpoint = number
        rng_states = dist.gather_objects(CheckpointManager.capture_rng(), self.dist)
        if self.sharded:  # every process writes its shards, synchronously
            def on_rank0(fn: Any) -> Any:
                return dist.main_process_first_result(fn, self.dist)

            return self.checkpoints.save_sharded(number, self._record(), self._saved_slots(), rng_states, limit,
                                                 self.run_id, begin=on_rank0, finish=on_rank0)
        return dist.main_process_first_result(
            lambda: self.checkpoints.save(number, self._record(), self._saved_slots(), rng_states, limit, self.run_id),
            self.dist)

    def _settle_checkpoint(self) -> None:
        """Before an optimizer step: the checkpoint being written in the background must be on disk.
        Its write overlaps the step's rollout and backward; a failed write (a full disk) stops the
        run here, naming the checkpoint, before any weight changes after it."""
        dist.main_process_first_result(self.checkpoints.wait, self.dist)

    def _check_finite_weights(self, number: int) -> None:
        for slot, module in self.trained_slots().modules.items():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]  # shards: each its own
            bad = not all(bool(torch.isfinite(p).all()) for p in local)
            if dist.all_reduce_max([float(bad)], self.dist)[0] if self.sharded else bad:
                raise TrainingError(f"checkpoint-{number} was not written: {slot} has non-finite weights (the last "
                                    "optimizer step diverged). Lower the learning rate and resume from the previous "
                                    "checkpoint.")

    def _load_for_train(self, path: Union[str, os.PathLike], unchecked: tuple[str, ...] = ()) -> int:
        """Resume from ``path`` (comlrl's format or CoMLRL 1.4.3's); returns its checkpoint number.
        ``unchecked``: fingerprints that need not match (what only shapes training, for an export)."""
        from ..checkpoint.legacy import is_legacy_checkpoint

        path = Path(path)
        if is_legacy_checkpoint(path):
            from .legacy_resume import resume_legacy

            return resume_legacy(self, path)
        def checked(fingerprints: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in fingerprints.items() if k not in unchecked}

        state = self.checkpoints.load(path, self._saved_slots(), checked(self._fingerprints()), rank=self.dist.rank,
                                      saved_fingerprints=lambda s: checked(self._with_new_defaults(s["fingerprints"])))
        if state["world_size"] != self.dist.world_size and self.dist.is_main:
            logger.warning("comlrl: %s was written by %d process(es) and resumes on %d: the run continues within "
                           "float tolerance of the uninterrupted one, not bit for bit.", path, state["world_size"],
                           self.dist.world_size)
        self.backend.mark_stale()
        self.run_id = state["run_id"]
        self.state = TrainState.restore(state["counters"], state["log_window"])
        self.wandb_identity = state["wandb"]
        self.tracker_identities = dict(state["trackers"])
        self._reset_pending()
        self.load_algorithm_state(state["algorithm"], state.get("data"))
        logger.info("comlrl: resumed %s at epoch %d, env_step %d", path, self.state.epoch, self.state.env_step)
        return self.state.checkpoint

    def check_resumable(self, path: Union[str, os.PathLike]) -> None:
        """Raise now, before anything starts, what resuming from ``path`` would raise about it:
        :class:`ResumeMismatchError` listing what differs from this run's setup, or
        :class:`CheckpointError` for a checkpoint that does not verify. Reads only its JSON files
        (the full check of every tensor file is done by the resume itself)."""
        from ..checkpoint.legacy import is_legacy_checkpoint

        path = Path(path)
        if is_legacy_checkpoint(path):
            return
        saved = self._with_new_defaults(checkpoint_state(path)["fingerprints"])
        differences = compare_fingerprints(saved, self._fingerprints())
        if differences:
            raise ResumeMismatchError(str(path), differences)

    def _with_new_defaults(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A saved fingerprint record with the config fields it predates (added to comlrl after the
        checkpoint was written) at their defaults: a run that leaves them so resumes as before."""
        config = saved.get("config")
        if not isinstance(config, dict):
            return saved
        fixed = resumable_fields(type(self.args))
        defaults = {k: v for k, v in field_defaults(type(self.args)).items() if k not in config and k not in fixed}
        return {**saved, "config": {**config, **defaults}}

    def save_checkpoint(self, output_dir: Union[str, os.PathLike]) -> str:
        """Write the current state as a checkpoint directory ``output_dir`` (CoMLRL's API) and
        return its path; the trainer must be between buffers (not inside a failed train())."""
        self._check_open()
        target = Path(output_dir)
        number = self.state.checkpoint + 1
        self.state.checkpoint = number
        self._check_finite_weights(number)
        rng_states = dist.gather_objects(CheckpointManager.capture_rng(), self.dist)
        return dist.main_process_first_result(
            lambda: str(self.checkpoints.write_named(target, number, self._record(), self._saved_slots(),
                                                     rng_states)),
            self.dist)

    def load_checkpoint(self, checkpoint: Union[str, os.PathLike]) -> dict[str, int]:
        """Restore a checkpoint into this trainer without training (CoMLRL's API); the next
        train() continues from it. Returns its counters."""
        self._check_open()
        self._table("train")
        self._load_for_train(checkpoint)
        return self.state.counters()

    def _load_for_export(self, checkpoint: Union[str, os.PathLike]) -> dict[str, int]:
        """:meth:`load_checkpoint` for ``save_model`` only (``comlrl export``): what only shapes
        training (reward, formatters, transition, sampling settings, data) need not be the run's."""
        self._check_open()
        self._table("train")
        self._load_for_train(checkpoint, unchecked=_TRAINING_ONLY)
        return self.state.counters()

    # ------------------------------------------------------------------------------------------
    # saving for use, closing
    # ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: Union[str, os.PathLike], merge_adapters: bool = False) -> Path:
        """Write every agent as a standard transformers directory ``output_dir/agent_i`` with its
        tokenizer (``AutoModelForCausalLM.from_pretrained`` loads it). LoRA agents are written as PEFT
        adapter directories, or with ``merge_adapters=True`` as plain models. A new ``output_dir`` is
        written to a hidden sibling and renamed into place; an existing one only when it holds
        nothing but an earlier export (recorded in ``.comlrl-export.json``), each folder replaced
        whole: what an export did not write is never replaced. Under torchrun every process calls
        it and rank 0 writes. After a ``train()`` that logged to W&B, the folder is recorded in that
        run's summary as ``final_model_saved`` (CoMLRL 1.4.3 logs it there)."""
        if not isinstance(merge_adapters, bool):
            raise ConfigError(f"merge_adapters must be True or False, got {merge_adapters!r}.")
        if self.sharded:
            written = self._save_sharded_model(Path(output_dir))
        else:
            written = dist.main_process_first_result(lambda: write_agents(Path(output_dir), self._exported(),
                                                                           merge_adapters, self.run_id), self.dist)
        self._note_final_model(written)
        return written

    def _note_final_model(self, folder: Path) -> None:
        """CoMLRL 1.4.3 logs ``final_model_saved`` (the folder) to W&B when its model is saved; here
        the W&B run of the last ``train()`` gets it in its summary (where the W&B API and the runs
        table read a run's final values). A W&B failure is said, never raised: the model is saved."""
        from ..tracking import active_trackers
        from ..tracking.wandb import WandbSink

        if self.wandb_identity is None or not self.dist.is_main or \
                "wandb" not in active_trackers(self.args.report_to, self.wandb_config):
            return
        try:
            sink = WandbSink(self.wandb_config or {}, {}, identity=self.wandb_identity)
            sink.summarize({"final_model_saved": str(folder)})
            sink.close()
        except Exception as exc:  # noqa: BLE001 - the export is written; W&B missing one summary value is not fatal
            logger.warning("comlrl: saved the model to %s but could not record final_model_saved in W&B run %s "
                           "(%s: %s).", folder, self.wandb_identity.get("id"), type(exc).__name__, exc)

    def _save_sharded_model(self, target: Path) -> Path:
        """:meth:`save_model` of sharded agents: every process hands its shards to rank 0 (one agent at
        a time, in CPU memory), which writes each folder as a checkpoint lays it out, without the
        optimizer: the same files ``from_pretrained`` loads."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from ..checkpoint.sharded import unique_state

        slot_of = {id(m): slot for slot, m in self.trained_slots().modules.items()}
        written = []
        for folder, model, _ in self._exported():
            names = set(unique_state(model))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            written.append((folder, {k: v.contiguous() for k, v in full.items() if k in names},
                            self._layout(slot_of[id(model)], model)))

        def fill(tmp: Path) -> None:
            for folder, tensors, layout in written:
                (tmp / folder).mkdir(parents=True)
                save_file(tensors, str(tmp / folder / layout.files()[0]), metadata={"format": "pt"})
                for name, content in layout.sidecars.items():
                    (tmp / folder / name).parent.mkdir(parents=True, exist_ok=True)
                    (tmp / folder / name).write_bytes(content)

        return dist.main_process_first_result(lambda: (write_export(target, fill, "save_model", self.run_id),
                                                       target)[1], self.dist)

    def _exported(self) -> list[tuple[str, torch.nn.Module, Any]]:
        """``(folder, model, tokenizer)`` of everything :meth:`save_model` writes."""
        return [(f"agent_{i}", m, t) for i, (m, t) in enumerate(zip(self.agents, self.tokenizers))]


def write_agents(target: Path, exported: list[tuple[str, torch.nn.Module, Any]], merge_adapters: bool,
                  run_id: Optional[str] = None) -> Path:
    """Write ``exported`` as ``target/<folder>`` model directories (see
    :func:`comlrl.checkpoint.export.write_export`: only ever replacing an earlier export)."""
    from ..adapters import AdapterAgent
    from ..models.actor_critic import unwrap_policy

    def fill(tmp: Path) -> None:
        for folder, model, tokenizer in exported:
            if isinstance(unwrap_policy(model), AdapterAgent):
                model.save_pretrained(tmp / folder, merged=merge_adapters)
            else:
                model.save_pretrained(tmp / folder)
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp / folder)

    write_export(target, fill, origin="save_model", run_id=run_id)
    return target
