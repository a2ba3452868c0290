"""Stand-in for vllm.distributed.weight_transfer (0.33): the trainer side of a full-resync backend.

``send_weights`` drives the client through start -> update -> finish, as vLLM's engines do; the
update carries the tensors themselves where the IPC backend carries CUDA IPC handles.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


class ModuleSource:
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            yield name, param.detach()


class _TrainerEngine:
    def __init__(self, init_info: Any, client: Any, source: ModuleSource):
        self.init_info, self.client, self.source = init_info, client, source
        self.sends = 0

    def send_weights(self) -> None:
        names, dtypes, shapes, tensors = [], [], [], []
        for name, tensor in self.source.iter_full():
            size = tensor.numel() * tensor.element_size()
            if self.init_info.packed and size > self.init_info.packed_buffer_size_bytes:
                raise ValueError(f"Tensor {name!r} has size {size} exceeding buffer_size_bytes "
                                 f"{self.init_info.packed_buffer_size_bytes}")
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
            tensors.append(tensor.clone())
        self.client.start_weight_update()
        self.client.update_weights({"names": names, "dtype_names": dtypes, "shapes": shapes, "tensors": tensors})
        self.client.finish_weight_update()
        self.sends += 1


class WeightTransferTrainerFactory:
    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> _TrainerEngine:
        for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                       "finish_weight_update"):
            if not callable(getattr(client, method, None)):
                raise TypeError(f"client lacks {method}() (VLLMWeightSyncClient protocol)")
        if not isinstance(source, ModuleSource):
            raise TypeError("the IPC backend resyncs every weight: pass source=ModuleSource(model)")
        client.init_weight_transfer_engine({"packed": init_info.packed})
        return _TrainerEngine(init_info, client, source)


__all__ = ["ModuleSource", "WeightTransferTrainerFactory"]
