"""Stand-in for vLLM 0.33's offline API (see ../README.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM

__version__ = "0.33.0+comlrl-fake"


@dataclass
class SamplingParams:
    """The fields of vllm.SamplingParams 0.33 that comlrl sets (others keep vLLM's defaults)."""

    n: int = 1
    temperature: float = 1.0  # vLLM: > 2 refused, (0, 0.01) raised to 0.01
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True


def _check_sampling(sp: "SamplingParams") -> None:
    if sp.temperature > 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {sp.temperature}")
    if sp.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable), or at least 1, got {sp.top_k}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


# Keyword arguments of vllm.LLM.__init__ in 0.33 (EngineArgs fields arrive through **kwargs there;
# the ones comlrl or its tests pass are listed).
_LLM_KWARGS = {"tokenizer", "seed", "dtype", "gpu_memory_utilization", "enforce_eager", "max_model_len",
               "load_format", "enable_prefix_caching", "weight_transfer_config", "tensor_parallel_size",
               "device_ids", "max_num_seqs"}


def weight_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


class LLM:
    instances: list["LLM"] = []

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - _LLM_KWARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = kwargs
        config = AutoConfig.from_pretrained(model)
        if not getattr(config, "architectures", None):
            raise ValueError("No model architectures are specified")  # as vLLM's model registry
        if kwargs.get("load_format") == "dummy":
            with torch.random.fork_rng(devices=[]):  # the real engine lives in another process
                torch.manual_seed(12345)  # random weights, as vLLM's dummy loader
                self.model = AutoModelForCausalLM.from_config(config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model)
        dtype = kwargs.get("dtype", "auto")
        if dtype != "auto":
            self.model.to(getattr(torch, dtype))
        self.model.eval()
        self.transfer_info: Optional[dict] = None
        self.updating = False
        self.cache_from_old_weights = False
        self.weight_updates = 0
        self.blocks_in_use = False  # tests set it to see a refused prefix-cache reset
        self.shut_down = False
        # vLLM 0.33: LLM.llm_engine.engine_core.shutdown() stops the engine process.
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))
        self.requests: list[tuple[dict, SamplingParams]] = []
        self.weights_at_generate: list[float] = []  # a checksum of the engine's weights at each generate
        LLM.instances.append(self)

    def _shutdown(self) -> None:
        self.shut_down = True

    # --- weight transfer (vllm.entrypoints.rl.offline.RLOfflineMixin) ------------------------------
    def init_weight_transfer_engine(self, request: dict) -> None:
        self.transfer_info = request["init_info"]

    def start_weight_update(self) -> None:
        if self.transfer_info is None:
            raise RuntimeError("start_weight_update before init_weight_transfer_engine")
        if self.updating:
            raise RuntimeError("start_weight_update while an update is in progress")
        self.updating = True

    def update_weights(self, request: dict) -> None:
        if not self.updating:
            raise RuntimeError("update_weights outside start_weight_update / finish_weight_update")
        info = request["update_info"]
        params = dict(self.model.named_parameters())
        for name, dtype_name, shape, tensor in zip(info["names"], info["dtype_names"], info["shapes"], info["tensors"]):
            if name not in params:
                raise KeyError(f"unknown weight {name!r}")
            if list(params[name].shape) != list(shape) or list(tensor.shape) != list(shape):
                raise ValueError(f"shape mismatch for {name}")
            if dtype_name != str(tensor.dtype).removeprefix("torch."):
                raise ValueError(f"dtype name mismatch for {name}")
            with torch.no_grad():
                params[name].copy_(tensor)
        self.cache_from_old_weights = True

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self.updating = False
        self.weight_updates += 1

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """False (cache kept) while blocks are in use, as vLLM's block pool answers."""
        if self.blocks_in_use:
            return False
        self.cache_from_old_weights = False
        return True

    # --- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: Any = True,
                 lora_request: Any = None, priority: Any = None, tokenization_kwargs: Any = None,
                 mm_processor_kwargs: Any = None) -> list[RequestOutput]:
        if self.updating:
            raise RuntimeError("generate during a weight update")
        if self.cache_from_old_weights:
            raise RuntimeError("generate with a prefix cache computed by the previous weights "
                               "(reset_prefix_cache was not called after the update)")
        self.weights_at_generate.append(weight_checksum(self.model))
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        outputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            _check_sampling(sp)
            self.requests.append((prompt, sp))
            outputs.append(RequestOutput(str(i), list(prompt["prompt_token_ids"]),
                                         [self._sample(list(prompt["prompt_token_ids"]), sp)]))
        return outputs

    @torch.no_grad()
    def _sample(self, ids: list[int], sp: SamplingParams) -> CompletionOutput:
        generator = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        stops = set(sp.stop_token_ids or [])
        if not sp.ignore_eos and self.model.config.eos_token_id is not None:
            stops.add(self.model.config.eos_token_id)
        out: list[int] = []
        reason = "length"
        while len(out) < sp.max_tokens:
            logits = self.model(input_ids=torch.tensor([ids + out])).logits[0, -1].float() / sp.temperature
            if sp.top_k and sp.top_k < logits.numel():
                kth = torch.topk(logits, sp.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -torch.inf)
            probs = torch.softmax(logits, dim=-1)
            if sp.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= sp.top_p
                probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
            token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            if token in stops:
                reason = "stop"
                break
        return CompletionOutput(0, "", out, reason)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
