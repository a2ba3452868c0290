"""Compute copies of an agent's weights in a lower precision, for sampling under mixed precision.

With ``mixed_precision="bf16"`` the agents keep float32 weights (the masters AdamW updates: its
steps at RL learning rates are far below bfloat16's resolution and would round away) and compute
in bfloat16. Under ``torch.autocast`` every matrix product casts its float32 weight to bfloat16
again, at every forward; a rollout's decode steps are many small forwards of the same weights, so
the casts cost as much as the products. A :class:`ComputeCopy` is the module cast once: bfloat16
parameters, refreshed from the masters once after each optimizer step (what FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` does for sharded models), which sampling runs on
directly, without autocast.

The update's forwards and backwards run on the same copy (:meth:`ComputeCopy.trained`): each
weight gradient of a matrix product is computed in bfloat16, as autocast computes it too, and added
to the master's float32 ``.grad`` as soon as backward has accumulated it; embedding lookups read the
float32 master, as under autocast. Autocast instead casts every weight again
at every forward, runs the residual stream and the norms in float32, and routes each weight
gradient through a cast node: 1.4x the time of the same forward and backward on bfloat16 weights
(a Qwen2.5-0.5B-shaped model, 8 rows x 46 tokens), where the copy takes 1.2x.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch

__all__ = ["ComputeCopy", "wants_compute_copy"]


def wants_compute_copy(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> Optional[str]:
    """None if ``model`` gets a ``dtype`` compute copy for sampling; otherwise why not."""
    from ..adapters import AdapterAgent

    if dtype is None:
        return "no compute dtype"
    if isinstance(model, AdapterAgent) or getattr(model, "peft_config", None) \
            or getattr(model, "_hf_peft_config_loaded", False):
        return "adapters (LoRA agents sample with their shared base and adapters under autocast)"
    params = list(model.parameters())
    if not params or any(not p.is_floating_point() for p in params):
        return "parameters that are not floating point"
    if all(p.dtype == dtype for p in params):
        return f"already in {dtype}"
    if any(hasattr(p, "to_local") for p in params):
        return "sharded parameters (FSDP2's MixedPrecisionPolicy casts them)"
    return None


class ComputeCopy:
    """``module`` with every floating parameter cast to ``dtype`` (buffers shared with the master:
    rotary frequencies and the like stay in their precision), frozen and in eval mode. Parameters
    tied in the master (embedding and output head) stay tied in the copy.

    :meth:`refresh` copies the master's current values in (one cast per parameter); the copy is
    the same function as the master evaluated in ``dtype``.
    """

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.master, self.dtype = master, dtype
        memo: dict[int, object] = {}
        with torch.no_grad():
            for p in master.parameters():  # parameters() lists a tied tensor once: the copy keeps the tie
                memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            for b in master.buffers():
                memo[id(b)] = b
            self.module = copy.deepcopy(master, memo)
        self.module.eval()
        self._pairs = [(c, m) for c, m in zip(self.module.parameters(), master.parameters())]
        if len(self._pairs) != len(list(master.parameters())) or any(c.shape != m.shape for c, m in self._pairs):
            raise RuntimeError(f"the {dtype} copy of {type(master).__name__} does not mirror its parameters")
        self.refreshes = 0

    @torch.no_grad()
    def refresh(self) -> None:
        """The master's current weights, cast into the copy."""
        copies, masters = zip(*self._pairs)
        torch._foreach_copy_(list(copies), list(masters))
        self.refreshes += 1

    @contextlib.contextmanager
    def trained(self) -> Iterator[torch.nn.Module]:
        """The copy, for forwards whose backward trains the master: inside, the copy's parameters
        require gradients where the master's do, and each gradient backward accumulates on one is
        added to its master's ``.grad`` (cast to the master's dtype) and freed at once, so no more
        than the gradients in flight exist in ``dtype``. Gradients of several backwards sum in the
        master's dtype, as under autocast. The copy must be current (:meth:`refresh` after the
        master changed): its forward is the function whose gradient reaches the master.

        Embedding lookups read the master's weight and cast their output to ``dtype``, as under
        autocast (which leaves ``embedding`` in float32): an embedding's backward adds up one row
        per occurrence of a token, and on the CPU it adds in the weight's dtype, so a token seen a
        few hundred times in a micro-batch would lose most of its gradient in bfloat16 (4096
        gradients of 1/3 sum to 128 there). A tied output head keeps the copy's weight."""
        handles, swapped = [], []
        masters = {id(c): m for c, m in self._pairs}
        try:
            for c, m in self._pairs:
                c.requires_grad_(m.requires_grad)
                if m.requires_grad:
                    handles.append(c.register_post_accumulate_grad_hook(_grad_into(m)))
            for module in self.module.modules():
                if isinstance(module, torch.nn.Embedding) and id(module.weight) in masters:
                    swapped.append((module, module.weight))
                    module.weight = masters[id(module.weight)]
                    handles.append(module.register_forward_hook(_cast_output(self.dtype)))
            yield self.module
        finally:
            for handle in handles:
                handle.remove()
            for module, weight in swapped:
                module.weight = weight
            for c, _ in self._pairs:
                c.requires_grad_(False)
                c.grad = None


def _cast_output(dtype: torch.dtype):
    """A forward hook: the module's output in ``dtype``."""

    def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def _grad_into(master: torch.nn.Parameter):
    """A post-accumulate-grad hook: the copy parameter's gradient, added to ``master.grad``."""

    def hook(param: torch.Tensor) -> None:
        with torch.no_grad():
            if master.grad is None:
                master.grad = param.grad.to(master.dtype)
            else:
                master.grad.add_(param.grad)
        param.grad = None

    return hook
