"""Public helpers with CoMLRL's names: checkpoint metadata, formatters, tokenizers, model
sources, the reference KL, reward calling and processing, process context; plus comlrl's
``find_latest_checkpoint`` and ``set_seed``."""

from .._imports import require_torch

require_torch("comlrl.utils")  # before the first torch import: say how to install it

from .checkpoint import find_latest_checkpoint, read_checkpoint_metadata, set_seed
from .distributed import DistributedContext, local_context, unwrap_model
from .formatters import build_formatters
from .model_loading import infer_model_name, resolve_model_sources
from .reference_kl import (clone_reference_models, load_reference_models_from_sources, reference_kl_coef,
                           reference_kl_enabled, reference_kl_for_sequence, resolve_reference_devices,
                           validate_reference_kl_config)
from .reward_processor import RewardProcessors
from .reward_utils import (batched_reward, call_reward_function, normalize_reward_lengths, resolve_reward_range,
                           set_reward_range)
from .tokenizer_utils import apply_tokenizer_specials, ensure_pad_token, ensure_tokenizer, resolve_tokenizers

__all__ = [
    "read_checkpoint_metadata", "find_latest_checkpoint", "set_seed",
    "build_formatters",
    "ensure_pad_token", "ensure_tokenizer", "apply_tokenizer_specials", "resolve_tokenizers",
    "infer_model_name", "resolve_model_sources",
    "clone_reference_models", "load_reference_models_from_sources", "reference_kl_coef", "reference_kl_enabled",
    "reference_kl_for_sequence", "resolve_reference_devices", "validate_reference_kl_config",
    "RewardProcessors",
    "call_reward_function", "batched_reward", "normalize_reward_lengths", "resolve_reward_range", "set_reward_range",
    "DistributedContext", "local_context", "unwrap_model",
]
