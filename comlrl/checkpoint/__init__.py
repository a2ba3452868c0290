"""Checkpoints: the on-disk format (:mod:`.files`), what a state must hold (:mod:`.state`), the
directory lock (:mod:`.lock`), run fingerprints (:mod:`.fingerprint`), the owner of a run's saved
state (:mod:`.manager`), and reading CoMLRL 1.4.3 checkpoints (:mod:`.legacy`)."""

from .._imports import require_torch

require_torch("comlrl.checkpoint")  # before the first torch import: say how to install it

from .files import FORMAT_VERSION, MANIFEST_FILE, STATE_FILE, checkpoint_number, checkpoint_path, list_checkpoints
from .manager import CheckpointManager, Slots, latest_checkpoint, read_checkpoint

__all__ = ["FORMAT_VERSION", "MANIFEST_FILE", "STATE_FILE", "CheckpointManager", "Slots", "checkpoint_number",
           "checkpoint_path", "latest_checkpoint", "list_checkpoints", "read_checkpoint"]
