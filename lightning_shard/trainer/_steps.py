"""What ShardStrategy's step hooks add to the session's steps: Lightning's hooks, logging and warnings alone."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

log = logging.getLogger(__name__)


def backward_hooks_around(trainer: Any, loss: Tensor, backward: Callable[[], None]) -> None:
    """Lightning's ``on_before_backward`` / ``on_after_backward`` hooks around a backward the strategy runs
    outside Lightning's precision plugin (the pipeline schedule's, whose gradients are added here)."""
    call._call_callback_hooks(trainer, "on_before_backward", loss)
    call._call_lightning_module_hook(trainer, "on_before_backward", loss)
    backward()
    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_lightning_module_hook(trainer, "on_after_backward")


def report_skip(trainer: Any, total: int, is_global_zero: bool) -> None:
    """``skip_nonfinite``: warn about a skipped step and log the running count as ``shard/skipped_steps``."""
    log.warning(
        "ShardStrategy: non-finite loss or gradient at step %d; skipped the optimizer step on all ranks"
        " (%d skipped so far).",
        trainer.global_step,
        total,
    )
    if is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({"shard/skipped_steps": float(total)}, step=trainer.global_step)


def warn_recompiles(count: int) -> None:
    if count:
        rank_zero_warn(
            f"ShardStrategy(compile=...): torch.compile recompiled the blocks {count} time(s) after"
            " their first graph. Something they depend on changes between steps (a shape: pad batches to"
            " one length or pass compile={'dynamic': True}; a Python value read in forward). Run with"
            " TORCH_LOGS=recompiles to see the guard."
        )
