"""Stand-in for vllm.config (0.33): WeightTransferConfig."""

from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
