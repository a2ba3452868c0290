"""Continue, with comlrl, a run that CoMLRL 1.4.3 checkpointed.

What carries over: every agent's weights and AdamW state (moments, step count, hyper-parameters),
the completed epochs, ``env_step``, the run id and the W&B identity (so the run continues the same
curve in the same W&B run), and the Python / NumPy / torch random states. What cannot: 1.4.3
samples through ``model.generate`` with torch's global random stream and comlrl with per-row seeds,
so the samples after the resume are not those 1.4.3 would have drawn; 1.4.3 saves at epoch
boundaries only, so a resume starts at the next epoch. Settings, dataset, tokenizer vocabularies
and the agent count must match, as for comlrl's own checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._redact import redact
from ..exceptions import CheckpointError, ResumeMismatchError
from ..checkpoint.legacy import read_legacy_checkpoint
from ..checkpoint.rng import restore_rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["resume_legacy"]

logger = logging.getLogger("comlrl")

# 1.4.3 config fields whose value is not compared: they may change on resume (there, as here), or
# they do not change what is trained.
_PORTABLE = {"num_train_epochs", "agent_devices", "reference_devices", "parallel_training", "logging_steps",
             "eval_interval", "eval_num_samples", "eval_batch_size"}


def _differences(trainer: "Trainer", saved: Any) -> list[str]:
    ours = trainer.args.to_dict()  # secrets redacted, and so the saved ones (a 1.4.3 config may hold a key)
    theirs = {key: redact(value, key) for key, value in saved.config.items()}
    out = [f"config.{key}: saved {value!r}, now {ours[key]!r}" for key, value in sorted(theirs.items())
           if key in ours and key not in _PORTABLE and value != ours[key]]
    if len(saved.agent_states) != len(trainer.agents):
        out.append(f"num_agents: saved {len(saved.agent_states)}, now {len(trainer.agents)}")
    table = trainer._table("train")
    length = (saved.dataset or {}).get("length")
    if length is not None and length != len(table):
        out.append(f"dataset: saved {length} rows, now {len(table)}")
    fingerprint = (saved.dataset or {}).get("fingerprint")
    ours_fp = getattr(trainer.train_dataset, "_fingerprint", None)
    if fingerprint and ours_fp and fingerprint != ours_fp:
        out.append(f"dataset: saved fingerprint {fingerprint}, now {ours_fp}")
    for i, (entry, tokenizer) in enumerate(zip(saved.tokenizers, trainer.tokenizers)):
        vocab = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True, default=str).encode()).hexdigest()
        if entry.get("vocab") and entry["vocab"] != vocab:
            out.append(f"tokenizers[{i}]: another vocabulary")
    return out


def resume_legacy(trainer: "Trainer", path: Path) -> int:
    """Load a 1.4.3 checkpoint into ``trainer``; returns its checkpoint number."""
    from .state import TrainState

    if not getattr(trainer, "legacy_resume_supported", True):
        raise CheckpointError(f"{path} was written by CoMLRL 1.4.3; continuing a 1.4.3 {type(trainer).__name__} run "
                              "(its critics and their optimizers) is not supported. Start a fresh comlrl run, or "
                              "load the 1.4.3 weights into the models you pass (agents=..., critics=...).")
    saved = read_legacy_checkpoint(path)
    family = saved.trainer_class.rsplit(".", 1)[-1]
    if family != type(trainer).__name__:
        raise ResumeMismatchError(str(path), [f"trainer: saved {family}, now {type(trainer).__name__}"])
    differences = _differences(trainer, saved)
    if differences:
        raise ResumeMismatchError(str(path), differences)
    for i, (model, optimizer, state, opt_state) in enumerate(zip(trainer.agents, trainer.optimizers,
                                                                 saved.agent_states, saved.optimizer_states)):
        try:
            model.load_state_dict(state, strict=True)
            optimizer.load_state_dict(opt_state)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"legacy checkpoint {path}: agent {i} does not fit this trainer's model or "
                                  f"optimizer ({type(exc).__name__}: {exc}).") from exc
    steps = [int(s.get("step", 0)) for opt in trainer.optimizers for s in opt.state_dict()["state"].values()]
    global_step = max(steps, default=0)
    for scheduler in trainer.schedulers:  # 1.4.3 has no schedule: start ours where its steps stand
        scheduler.last_epoch = global_step
    _restore_rng(saved)
    trainer.backend.mark_stale()
    trainer.state = TrainState(epoch=saved.epoch, items_in_epoch=0, global_step=global_step,
                               env_step=saved.env_step, checkpoint=saved.sequence,
                               last_logged_env_step=saved.env_step)
    if saved.run_id:
        trainer.run_id = saved.run_id
    trainer.wandb_identity = saved.wandb
    trainer.tracker_identities = {}  # 1.4.3 logged to W&B only
    trainer._reset_pending()
    logger.warning("comlrl: resumed a CoMLRL 1.4.3 checkpoint %s at epoch %d, env_step %d: weights, optimizer "
                   "state, counters and the W&B run carry over; sampling continues with comlrl's own seeds.",
                   path, saved.epoch, saved.env_step)
    return saved.sequence


def _restore_rng(saved: Any) -> None:
    import numpy as np

    version, internal, gauss = saved.rng.python
    numpy_state = saved.rng.numpy
    json_part = {"python": [version, list(internal), gauss],
                 "numpy": [numpy_state[0], np.asarray(numpy_state[1]).tolist(), int(numpy_state[2]),
                           int(numpy_state[3]), float(numpy_state[4])]}
    tensors = {"torch_cpu": saved.rng.torch}
    for i, state in enumerate(saved.rng.cuda or []):
        tensors[f"torch_cuda_{i}"] = state
    restore_rng_state(json_part, tensors)
