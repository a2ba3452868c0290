"""Rollouts on vLLM: ``rollout_backend="vllm"`` (optional; the ``vllm`` extra, ``pip install -e ".[vllm]"``, CUDA).

Each agent gets its own colocated ``vllm.LLM`` engine, built from the agent's config and tokenizer
with random ("dummy") weights and then given the agent's live weights through vLLM's weight-transfer
API (``vllm.distributed.weight_transfer``, the CUDA-IPC backend: the engine reads the trainer's
tensors on the same GPU, no copy through the host). After every optimizer step (and after a resume
loads a checkpoint) the agent is marked stale; its next rollout first pushes the new weights and
clears the engine's prefix cache, so no completion is ever sampled from old weights.

Sampling: one vLLM request per completion row with that row's own seed (the seed the transformers
backend derives for the row), so a row's completion does not depend on which rows share its batch.
The log-probabilities the loss uses are always recomputed by the training forward; vLLM only
chooses the tokens. Resumed == uninterrupted holds for weights, optimizer and data order as with
every backend; the samples are as reproducible as vLLM's kernels are (vLLM does not promise batch
invariance unless asked), so a resumed vLLM run may draw other tokens than the uninterrupted one.

Each engine is a vLLM process on its agent's GPU (``device_ids``). Because the trainer has already
initialised CUDA, vLLM starts it with ``spawn``: scripts that train with this backend need the usual
``if __name__ == "__main__":`` guard. The weight handles travel to that process pickled, which vLLM
allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; this module sets it (if unset) before
building the engines (the traffic stays between local processes). Temperatures outside [0.01, 2]
are refused (vLLM would refuse or silently change them).

Scope (refused with a clear error when the trainer is built): full-model agents on CUDA devices in
one process. LoRA agents (one shared base) and torchrun data parallelism need vLLM's multi-LoRA and
multi-rank weight transfer; use ``rollout_backend="auto"`` for them.

Written against vLLM 0.33 (``LLM``, ``SamplingParams``, ``WeightTransferConfig``,
``WeightTransferTrainerFactory``, ``IPCTrainerInitInfo``, ``ModuleSource``). Tested on CPU against a
stand-in with that interface (``tests/fake_vllm``); not run on a GPU with the real package yet.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from .._imports import install_hint
from ..exceptions import ConfigError
from .sampling import Rollout, SamplingParams
from .transformers_loop import _finish, _prepare

__all__ = ["VLLMRollout", "check_vllm_available", "INSTALL_HINT"]

logger = logging.getLogger("comlrl")

INSTALL_HINT = f"{install_hint('vllm')} (vLLM runs on CUDA GPUs)"
# Which vLLM weight-transfer backend moves an agent's weights into its engine, by the agent's
# device type. CUDA IPC needs trainer and engine on the same GPU, which is what colocated means.
TRANSFER_BACKENDS = {"cuda": "ipc"}
# GPU memory fraction the engines of one device share when the config does not say
# (the training step needs the rest: weights, gradients, AdamW state, activations).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.3
# Temperatures vLLM samples at as given: it refuses above 2 and raises values below 0.01 to 0.01
# (vllm/sampling_params.py), which would sample at another temperature than the loss scores.
TEMPERATURE_RANGE = (0.01, 2.0)
# Packed IPC transfers go through one buffer; vLLM's default (1 GiB) is raised to the largest
# weight when that is bigger (a 3B model's float32 embedding is 1.2 GB).
MIN_TRANSFER_BUFFER_BYTES = 1 << 30


def check_vllm_available(temperature: float = 1.0) -> None:
    """Raise :class:`ConfigError` unless ``import vllm`` can work and vLLM samples at ``temperature``."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout_backend='vllm' needs the vLLM package, which is not installed: {INSTALL_HINT}. "
                          "Or use rollout_backend='auto' (transformers models sampled in-process).")
    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ConfigError(f"rollout_backend='vllm' samples at temperatures in [{low}, {high}] only (vLLM refuses higher "
                          f"ones and silently raises lower ones to {low}); got temperature={temperature}. Change "
                          "temperature, or use rollout_backend='auto'.")


class _LLMClient:
    """Adapts an in-process ``vllm.LLM`` to the four calls of vLLM's ``VLLMWeightSyncClient``
    protocol (the ``LLM`` methods take the request dicts the HTTP routes take)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device; nothing otherwise."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _engine_dtype(model: torch.nn.Module, mixed_precision: Optional[str]) -> str:
    if mixed_precision == "bf16":
        return "bfloat16"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


class VLLMRollout:
    """The rollout backend on one vLLM engine per agent (see the module docstring).

    Args:
        models: the N agents (full ``transformers`` causal LMs, on CUDA).
        tokenizers: each agent's tokenizer (prompts are encoded here, as with every backend).
        seed: the run's seed (engine-level; every request carries its own seed as well).
        gpu_memory_utilization: fraction of its GPU each engine may take; None = 0.3 shared by the
            engines on that device.
        mixed_precision: the trainer's setting; ``"bf16"`` runs the engines in bfloat16.
        engine_kwargs: more ``vllm.LLM`` keyword arguments (e.g. ``max_model_len``,
            ``enforce_eager``); they override the ones set here.
    """

    def __init__(self, models: Sequence[torch.nn.Module], tokenizers: Sequence[Any], *, seed: int = 0,
                 gpu_memory_utilization: Optional[float] = None, mixed_precision: Optional[str] = None,
                 engine_kwargs: Optional[dict[str, Any]] = None):
        check_vllm_available()
        devices = [next(m.parameters()).device for m in models]
        for a, device in enumerate(devices):
            if device.type not in TRANSFER_BACKENDS:
                raise ConfigError(
                    f"rollout_backend='vllm' shares each agent's weights with its vLLM engine on the same GPU "
                    f"(CUDA IPC), but agent {a} is on {device}. Put the agents on CUDA devices (agent_devices='cuda' or a"
                    " list of CUDA devices), or use rollout_backend='auto'.")
        # The weight updates reach each engine process as CUDA IPC handles, which vLLM passes between
        # its own local processes with pickle only when this is set (read when an engine starts).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        vllm = importlib.import_module("vllm")
        vllm_config = importlib.import_module("vllm.config")
        transfer = importlib.import_module("vllm.distributed.weight_transfer")
        self.vllm = vllm
        self.models, self.tokenizers = list(models), list(tokenizers)
        self._dirs = []
        self.engines, self.senders = [], []
        for a, (model, tokenizer, device) in enumerate(zip(self.models, self.tokenizers, devices)):
            share = gpu_memory_utilization if gpu_memory_utilization is not None else \
                DEFAULT_GPU_MEMORY_UTILIZATION / devices.count(device)
            # The engine is built from the agent's config and tokenizer only (random weights): the
            # live weights arrive by transfer before its first rollout, whatever their origin.
            folder = tempfile.TemporaryDirectory(prefix=f"comlrl-vllm-agent{a}-")
            self._dirs.append(folder)
            config = model.config
            if not getattr(config, "architectures", None):  # vLLM picks its model class by this name
                config = type(config).from_dict({**config.to_dict(), "architectures": [type(model).__name__]})
            config.save_pretrained(folder.name)
            tokenizer.save_pretrained(folder.name)
            backend = TRANSFER_BACKENDS[device.type]
            kwargs = dict(model=folder.name, tokenizer=folder.name, load_format="dummy", seed=seed,
                          dtype=_engine_dtype(model, mixed_precision), gpu_memory_utilization=share,
                          enable_prefix_caching=True,
                          weight_transfer_config=vllm_config.WeightTransferConfig(backend=backend))
            if device.type == "cuda":  # the engine on its agent's GPU (IPC shares memory within one GPU)
                kwargs["device_ids"] = [_cuda_index(device)]
            kwargs.update(engine_kwargs or {})
            try:
                llm = vllm.LLM(**kwargs)
            except Exception as exc:  # vLLM's own errors (no GPU, out of memory, unsupported model)
                raise ConfigError(f"vLLM could not build an engine for agent {a} ({type(model).__name__} on "
                                  f"{device}): {exc}") from exc
            init_info = importlib.import_module(f"vllm.distributed.weight_transfer.{backend}_engine")
            largest = max(p.numel() * p.element_size() for p in model.parameters())
            with _on_device(device):  # the sender exports its tensors from the current CUDA device
                sender = transfer.WeightTransferTrainerFactory.trainer_init(
                    init_info=init_info.IPCTrainerInitInfo(
                        rank=0, packed=True, packed_buffer_size_bytes=max(MIN_TRANSFER_BUFFER_BYTES, largest)),
                    client=_LLMClient(llm), source=transfer.ModuleSource(model))
            self.engines.append(llm)
            self.senders.append(sender)
        self.devices = devices
        self.stale = set(range(len(self.models)))
        self.weight_syncs = [0] * len(self.models)

    def mark_stale(self, agents: Optional[Sequence[int]] = None) -> None:
        """The agents' weights changed (optimizer step, checkpoint load): push them before their
        next rollout."""
        self.stale.update(range(len(self.models)) if agents is None else agents)

    def _sync(self, a: int) -> None:
        if a not in self.stale:
            return
        with torch.no_grad(), _on_device(self.devices[a]):
            self.senders[a].send_weights()
        # Cached prompt keys/values were computed by the old weights (finishing an update keeps them).
        if self.engines[a].reset_prefix_cache() is False:
            raise RuntimeError(f"vLLM could not clear agent {a}'s prefix cache after a weight update (requests still "
                               "running?); its next completions would reuse keys and values of the old weights.")
        self.weight_syncs[a] += 1
        self.stale.discard(a)

    def sample(self, prompts: Sequence[Sequence[str]], seeds: Sequence[Sequence[Sequence[int]]],
               params: SamplingParams, eos_token_ids: Sequence[Sequence[int]],
               add_special_tokens: Sequence[bool]) -> list[Rollout]:
        """Every agent's completions for one turn: ``prompts[a]`` (G strings), ``seeds[a]``
        (``[G][K]``); returns one :class:`comlrl.rollout.Rollout` per agent, rows prompt-major."""
        prepared = [_prepare(m, t, p, s, params, add)
                    for m, t, p, s, add in zip(self.models, self.tokenizers, prompts, seeds, add_special_tokens)]
        for a in range(len(self.models)):
            self._sync(a)
        jobs = [(a, p, [seed for group in seeds[a] for seed in group]) for a, p in enumerate(prepared)]
        if len(jobs) > 1:  # each engine runs in its own process: the agents generate at the same time
            with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="comlrl-vllm") as pool:
                completions = list(pool.map(lambda job: self._generate(*job, params, eos_token_ids[job[0]]), jobs))
        else:
            completions = [self._generate(*job, params, eos_token_ids[job[0]]) for job in jobs]
        return [_finish(p, c, t, e) for p, c, t, e in zip(prepared, completions, self.tokenizers, eos_token_ids)]

    def _generate(self, a: int, prepared: Any, row_seeds: list[int], params: SamplingParams,
                  eos_token_ids: Sequence[int]) -> torch.Tensor:
        """``[R, T]`` completion ids of agent ``a``: one request per row, right-padded after EOS."""
        mask = prepared.prompt_mask.bool().cpu()
        ids = prepared.prompt_ids.cpu()
        requests = [{"prompt_token_ids": ids[r][mask[r]].tolist()} for r in range(ids.shape[0])]
        stops = sorted(set(eos_token_ids))
        # Stop exactly where the transformers backend stops: at the trainer's end-of-sequence ids
        # (ignore_eos: not at a different one the engine may read from the model's generation config).
        sampling = [self.vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=int(params.top_k or 0),
            max_tokens=params.max_new_tokens, seed=seed, stop_token_ids=stops, ignore_eos=True, detokenize=False)
            for seed in row_seeds]
        outputs = self.engines[a].generate(requests, sampling_params=sampling, use_tqdm=False)
        rows = [list(out.outputs[0].token_ids) for out in outputs]
        if len(rows) != len(requests) or any(not row for row in rows):
            raise RuntimeError(f"vLLM returned {len(rows)} completions for {len(requests)} requests "
                               "(or an empty one); expected one non-empty completion per request.")
        stops_set = set(stops)
        if any(len(row) > params.max_new_tokens or (len(row) < params.max_new_tokens and row[-1] not in stops_set)
               for row in rows):
            raise RuntimeError(f"vLLM stopped a completion elsewhere than at an end-of-sequence token {stops} or "
                               f"after max_new_tokens={params.max_new_tokens} tokens.")
        out = torch.nn.utils.rnn.pad_sequence([torch.tensor(row, dtype=torch.long) for row in rows], batch_first=True,
                                              padding_value=self.tokenizers[a].pad_token_id)
        return out.to(prepared.prompt_ids.device)

    def close(self) -> None:
        """Shut the engines down (their processes and GPU memory) and remove the config folders."""
        for llm in self.engines:
            shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
        self.engines, self.senders = [], []
        for folder in self._dirs:
            folder.cleanup()
        self._dirs = []
