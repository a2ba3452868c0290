"""Device placement for agents, critics and reference models.

Specs follow CoMLRL's conventions: ``None`` or ``"auto"`` (pick automatically), one device string
for all (``"cuda:0"``), or a list with one entry (used for all) or one entry per model.
``parallel_training`` is ``"none"`` (models run one after another) or ``"mp"`` (each agent on its
own device, agents' rollouts running at the same time).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from ..exceptions import ConfigError

__all__ = ["DeviceScheduler", "normalize_parallel_training", "PARALLEL_TRAINING_MODES"]

PARALLEL_TRAINING_MODES = ("none", "mp")

DeviceSpec = Union[None, str, torch.device, Sequence[Union[str, torch.device]]]


def normalize_parallel_training(mode: Any) -> str:
    """``"none"`` or ``"mp"`` from what a user may write (case, spaces, ``None``, ``"null"``)."""
    text = "none" if mode is None else str(mode).strip().lower()
    if text in ("null", ""):
        text = "none"
    if text not in PARALLEL_TRAINING_MODES:
        raise ConfigError(f"parallel_training must be one of {', '.join(PARALLEL_TRAINING_MODES)} (or None), "
                          f"got {mode!r}. Use 'none' to run agents one after another, 'mp' for one device per agent.")
    return text


def _device(value: Union[str, torch.device], kind: str) -> torch.device:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{kind}: {value!r} is not a device such as 'cpu', 'cuda' or 'cuda:1' ({exc}).") from None


def _auto(count: int) -> list[torch.device]:
    """Distinct GPUs when there are enough, else all on the first GPU, else the CPU."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * count
    if torch.cuda.device_count() < count:
        return [torch.device("cuda", 0)] * count
    return [torch.device("cuda", i) for i in range(count)]


class DeviceScheduler:
    """Turns device specs into one ``torch.device`` per model (no availability check here: the
    trainer checks that the devices exist when it places models)."""

    @staticmethod
    def resolve_devices(spec: DeviceSpec, num_devices: int, *, kind: str = "devices") -> list[torch.device]:
        """One device per model for ``num_devices`` models."""
        if not isinstance(num_devices, int) or num_devices < 1:
            raise ConfigError(f"{kind}: need at least one model to place, got {num_devices!r}.")
        if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
            return _auto(num_devices)
        if isinstance(spec, (str, torch.device)):
            return [_device(spec, kind)] * num_devices
        if not isinstance(spec, Sequence) or not spec:
            raise ConfigError(f"{kind} must be a device string or a non-empty list of them, got {spec!r}.")
        if len(spec) == 1:
            return DeviceScheduler.resolve_devices(spec[0], num_devices, kind=kind)
        if len(spec) != num_devices:
            raise ConfigError(f"{kind} length ({len(spec)}) must be 1 or {num_devices} (one per model); got {list(spec)!r}.")
        if any(isinstance(d, str) and d.strip().lower() == "auto" for d in spec):
            raise ConfigError(f"{kind}: 'auto' may only be given alone, not inside a list: {list(spec)!r}.")
        return [_device(d, kind) for d in spec]

    @staticmethod
    def resolve_single_device(*specs: DeviceSpec) -> torch.device:
        """The first spec that is not None (its first entry if a list); automatic if all are None."""
        for spec in specs:
            if spec is None:
                continue
            if not isinstance(spec, (str, torch.device)):
                if not isinstance(spec, Sequence) or not spec:
                    raise ConfigError(f"device list must not be empty, got {spec!r}.")
                spec = spec[0]
            return DeviceScheduler.resolve_devices(spec, 1)[0]
        return _auto(1)[0]

    @staticmethod
    def assign_devices(num_agents: int, agent_devices: DeviceSpec, critic_devices: DeviceSpec, *,
                       use_separate_critic: bool) -> tuple[list[torch.device], list[torch.device]]:
        """Agents' devices, and one critic device per agent (the agent's own unless separate
        critics are placed by ``critic_devices``)."""
        agents = DeviceScheduler.resolve_devices(agent_devices, num_agents, kind="agent_devices")
        if not use_separate_critic:
            return agents, list(agents)
        if critic_devices is None:
            return agents, list(agents)
        return agents, DeviceScheduler.resolve_devices(critic_devices, num_agents, kind="critic_devices")

    @staticmethod
    def assign_shared_critic_device(agent_devices: Sequence[torch.device], critic_devices: DeviceSpec) -> torch.device:
        """One device for a centralised critic: ``critic_devices`` if given, else the first agent's."""
        if critic_devices is None:
            return torch.device(agent_devices[0])
        return DeviceScheduler.resolve_devices(critic_devices, 1, kind="critic_devices")[0]


def check_available(device: torch.device, kind: str) -> torch.device:
    """``device`` if this machine has it; a ConfigError naming the setting otherwise."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{kind} asks for {device} but CUDA is not available here; use 'cpu' or leave it unset.")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"{kind} asks for {device} but only {torch.cuda.device_count()} CUDA device(s) exist.")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return device


def optional_devices(spec: DeviceSpec, count: int, kind: str) -> Optional[list[torch.device]]:
    """:meth:`DeviceScheduler.resolve_devices` for a spec that may be None (= not set)."""
    return None if spec is None else DeviceScheduler.resolve_devices(spec, count, kind=kind)
