"""fp8 under the FSDP engine: the scales of the float8 all-gathers (stages 2-3), precomputed after each step and
again whenever the weights change under them, and state dicts saved as plain tensors.

torchao's float8 all-gather casts each weight with a scale from its maximum; with ``precompute_scales`` those
scales are computed once after the optimizer step for every weight together (:mod:`lightning_shard.fp8`), so
weights loaded or initialised after a step would otherwise be gathered with their predecessors' scales.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard import fp8


def precomputes_scales(config: Any, stage: int) -> bool:
    """The float8 gathers' scales are precomputed after each step (stages 2-3, ``precompute_scales``)."""
    settings = config.fp8
    return settings is not None and settings.all_gather and settings.precompute_scales and stage >= 2


def precompute_after_steps(config: Any, stage: int, model: nn.Module, optimizers: list[Any]) -> None:
    if precomputes_scales(config, stage):
        fp8.precompute_after_steps(model, optimizers)


def refresh_scales(config: Any, stage: int, model: nn.Module) -> None:
    """New weights: the float8 gathers' scales computed after the last step are stale."""
    if precomputes_scales(config, stage):
        fp8.precompute_scales(model)


def plain_state_dict(config: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict with float8 training's tensor subclasses as plain tensors."""
    return state if config.fp8 is None else fp8.plain_state_dict(state)
