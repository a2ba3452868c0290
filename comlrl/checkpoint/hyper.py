"""Optimizer and learning-rate scheduler state from a checkpoint, checked against the live ones
(built from this run's config) before anything is loaded.

The manifest's hashes prove that a checkpoint is the one written, not that its writer was honest:
anyone can edit a state and recompute every hash. So each value resume would trust is checked for
type, range and consistency, and an error names the field:

* scheduler: exactly the live scheduler's fields (``load_state_dict`` sets every key it gets as an
  attribute); ``base_lrs`` the config's learning rates; ``last_epoch`` a non-negative int;
  ``_last_lr`` the rates the schedule gives at ``last_epoch``;
* optimizer groups: the live groups' parameters, every hyper-parameter the config decides
  (betas, eps, weight decay, ...) equal to the live one, ``lr`` the scheduler's current rate, no
  unknown key; implementation flags (``fused``, ``foreach``, ...) are the live optimizer's;
* moments: per parameter of the group, exactly the keys the optimizer keeps, each tensor of the
  parameter's shape and dtype and finite, second moments non-negative, ``step`` an integral count
  no larger than the scheduler's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from ..exceptions import CheckpointError

__all__ = ["check_scheduler_state", "check_optimizer_state"]

_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")  # how the step runs, not what it computes
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _fail(path: Path, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {field} {problem} (edited or forged?); nothing was loaded.")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_scheduler_state(path: Path, slot: str, scheduler: Any, saved: Any) -> None:
    """Check a saved scheduler state against the live ``scheduler`` (see the module docstring)."""
    live = scheduler.state_dict()
    where = f"schedulers[{slot!r}]"
    if not isinstance(saved, dict) or set(saved) != set(live):
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise _fail(path, where, f"holds {keys}, not this schedule's fields {sorted(live)}")
    if saved["base_lrs"] != live["base_lrs"]:
        raise _fail(path, f"{where}.base_lrs", f"is {saved['base_lrs']!r:.80}, while this run's config gives "
                                              f"{live['base_lrs']!r}")
    epoch = saved["last_epoch"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise _fail(path, f"{where}.last_epoch", f"must be a non-negative int, got {epoch!r:.40}")
    count = saved.get("_step_count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise _fail(path, f"{where}._step_count", f"must be a positive int, got {count!r:.40}")
    if saved.get("lr_lambdas", None) != live.get("lr_lambdas", None):
        raise _fail(path, f"{where}.lr_lambdas", f"is {saved.get('lr_lambdas')!r:.80}, not this schedule's")
    for key, value in saved.items():
        if key.startswith("_") and isinstance(live[key], bool) and not isinstance(value, bool):
            raise _fail(path, f"{where}.{key}", f"must be True or False, got {value!r:.40}")
    expected = _rates_at(scheduler, live["base_lrs"], epoch)
    last = saved["_last_lr"]
    if not isinstance(last, list) or len(last) != len(live["base_lrs"]) or not all(_number(v) for v in last) or \
            (expected is not None and not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
                                              for a, b in zip(last, expected))):
        raise _fail(path, f"{where}._last_lr", f"is {last!r:.80}, not the schedule's rates at step {epoch} "
                                               f"({expected!r})")


def _rates_at(scheduler: Any, base_lrs: list[float], epoch: int) -> Optional[list[float]]:
    """The learning rates a LambdaLR gives at ``epoch`` (None for other schedules)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or lambdas is None:
        return None
    return [base * fn(epoch) for base, fn in zip(base_lrs, lambdas)]


def check_optimizer_state(path: Path, slot: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                          scheduler_state: Optional[dict[str, Any]]) -> None:
    """Check a saved optimizer state (``{"state", "param_groups"}`` as ``load_state_dict`` takes
    it) against the live ``optimizer`` and the slot's (checked) saved scheduler state; the
    implementation flags of ``saved`` are set to the live ones."""
    where = f"optimizers[{slot!r}]"
    live = optimizer.state_dict()["param_groups"]
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live) or not all(isinstance(g, dict) for g in groups):
        raise _fail(path, f"{where}.param_groups", f"must be {len(live)} group(s) like this optimizer's")
    rates = scheduler_state["_last_lr"] if scheduler_state is not None else None
    for index, (group, mine) in enumerate(zip(groups, live)):
        _check_group(path, f"{where}.param_groups[{index}]", group, mine,
                     rates[index] if rates is not None else mine["lr"])
    last_epoch = scheduler_state["last_epoch"] if scheduler_state is not None else None
    _check_moments(path, where, optimizer, saved["state"], last_epoch)


def _check_group(path: Path, where: str, group: dict[str, Any], mine: dict[str, Any], rate: float) -> None:
    unknown = sorted(set(group) - set(mine))
    if unknown:
        raise _fail(path, where, f"holds unknown key(s) {unknown}")
    if group.get("params") != mine["params"]:
        raise _fail(path, f"{where}.params", "does not list this optimizer's parameters")
    if not _number(group.get("lr")) or not math.isclose(group["lr"], rate, rel_tol=1e-9, abs_tol=0.0):
        raise _fail(path, f"{where}.lr", f"is {group.get('lr')!r:.40}, while the schedule gives {rate!r}")
    for key, value in mine.items():
        if key in ("params", "lr"):
            continue
        if key in _IMPLEMENTATION or key not in group:
            group[key] = value  # the live optimizer decides how it runs (and a key an older torch lacked)
        elif _plain(group[key]) != _plain(value):
            raise _fail(path, f"{where}.{key}", f"is {group[key]!r:.60}, while this run's config gives {value!r}")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _check_moments(path: Path, where: str, optimizer: torch.optim.Optimizer, state: Any,
                   last_epoch: Optional[int]) -> None:
    params = {index: param for group, mine in zip(optimizer.param_groups, optimizer.state_dict()["param_groups"])
              for index, param in zip(mine["params"], group["params"])}
    if not isinstance(state, dict) or not set(state) <= set(params):
        raise _fail(path, f"{where}.state", "holds entries for parameters this optimizer does not have")
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    expected = {"step", *_ADAM_MOMENTS, *(("max_exp_avg_sq",) if amsgrad else ())} if adam else None
    for index, entry in state.items():
        field = f"{where}.state[{index}]"
        if not isinstance(entry, dict) or (expected is not None and set(entry) != expected):
            raise _fail(path, field, f"holds {sorted(entry) if isinstance(entry, dict) else entry!r:.60}, not "
                                     f"{sorted(expected or [])}")
        param = params[index]
        for key, value in entry.items():
            if key == "step":
                _check_step(path, f"{field}.step", value, last_epoch)
            elif isinstance(value, torch.Tensor):
                _check_moment(path, f"{field}.{key}", value, param, non_negative=key.endswith("_sq"))
            elif expected is not None:
                raise _fail(path, f"{field}.{key}", "must be a tensor")


def _check_step(path: Path, field: str, value: Any, last_epoch: Optional[int]) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point and value.dtype not in (torch.int32, torch.int64):
            raise _fail(path, field, f"must be one number, got a {value.dtype} tensor of shape {list(value.shape)}")
        value = value.item()
    if not _number(value) or value < 0 or value != int(value) or (last_epoch is not None and value > last_epoch):
        bound = f" no larger than the schedule's {last_epoch} steps" if last_epoch is not None else ""
        raise _fail(path, field, f"must be a whole number of steps{bound}, got {value!r:.40}")


def _check_moment(path: Path, field: str, value: torch.Tensor, param: torch.Tensor, non_negative: bool) -> None:
    if value.shape != param.shape or value.dtype != param.dtype:
        raise _fail(path, field, f"is a {value.dtype} tensor of shape {list(value.shape)}, while its parameter is "
                                 f"{param.dtype} of shape {list(param.shape)}")
    if not bool(torch.isfinite(value).all()) or (non_negative and bool((value < 0).any())):
        raise _fail(path, field, "holds " + ("non-finite values" if not bool(torch.isfinite(value).all())
                                             else "negative values (a second moment cannot be)"))
