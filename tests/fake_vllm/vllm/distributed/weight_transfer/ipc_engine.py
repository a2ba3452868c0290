"""Stand-in for vllm.distributed.weight_transfer.ipc_engine (0.33): IPCTrainerInitInfo."""

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class IPCTrainerInitInfo:
    backend: ClassVar[str] = "ipc"
    rank: int = field(kw_only=True)
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30  # vLLM: a single tensor larger than this is refused
