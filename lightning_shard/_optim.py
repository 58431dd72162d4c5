"""Optimizers the strategy rebuilds or re-steps: LR schedulers pointed at a replacement (stage 1's
ZeroRedundancyOptimizer, CPU-Adam, expert parallelism's param groups), a replacement built with the user's
hyperparameters, and a step replaced around the user's own."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s defaults that its class's constructor takes, to build another over other param groups.

    Some optimizers record defaults their constructor does not take (AdamW's ``decoupled_weight_decay``); every
    group carries them anyway, so only what the constructor accepts is passed."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def replace_step(optimizer: Optimizer, run: Callable[..., None]) -> None:
    """``optimizer.step(closure=None, **kwargs)`` becomes: the closure evaluated first (gradients enabled), as
    torch's optimizers do, then ``run(**kwargs)``; the closure's loss returned. A bound method: torch's LR
    schedulers wrap ``optimizer.step.__func__`` when built after this."""
    step = optimizer.step

    def replaced(self: Optimizer, closure: Any = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run(**kwargs)
        return loss

    optimizer.step = types.MethodType(functools.wraps(step)(replaced), optimizer)  # type: ignore[method-assign]


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point an LR scheduler at a replacement optimizer, with the step tracking torch's schedulers expect.

    Without the tracking, torch warns that ``optimizer.step()`` was overridden and cannot tell
    whether the scheduler steps after the optimizer.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


def rebind_schedulers(schedulers: list[Any], old: Sequence[Optimizer], new: Sequence[Optimizer]) -> None:
    """Point every scheduler of an optimizer in ``old`` at its replacement in ``new``."""
    for before, after in zip(old, new, strict=True):
        if after is before:
            continue
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is before:
                rebind_scheduler(scheduler, after)
