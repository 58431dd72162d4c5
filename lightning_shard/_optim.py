"""Pointing LR schedulers at a replacement optimizer (stage 1's ZeroRedundancyOptimizer, CPU-Adam)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer


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
