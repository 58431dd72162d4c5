"""Optimizer state keyed by parameter name, each entry held by one rank (ZeRO-1's owners, whole-matrix owners).

The layout is the one ``get_optimizer_state_dict`` gives at stages 2-3: ``{"state": {name: {field: value}},
"param_groups": [{hyperparameters, "params": [names]}]}``, so one checkpoint format serves every stage and world
size. These are the parts that do not depend on who holds what.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def on_every_rank(state: dict[str, Any]) -> dict[str, Any]:
    """Every rank's entries merged (a full checkpoint's state, on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return state
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    return {name: entry for part in gathered for name, entry in part.items()}


def saved_fields(
    meta: Any, key: str, name: str, empty: Callable[[TensorStorageMetadata], Any]
) -> dict[str, Any]:
    """The fields a checkpoint holds for parameter ``name`` under optimizer ``key``: ``empty(metadata)`` for a
    tensor (what DCP reads it into), ``None`` for a plain value."""
    prefix = f"{key}.state.{name}."
    return {
        k[len(prefix) :]: empty(md) if isinstance(md, TensorStorageMetadata) else None
        for k, md in meta.state_dict_metadata.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }


def load_hyperparameters(live: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Every param group's hyperparameters from the checkpoint, group by group."""
    if len(saved) != len(live):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved)} param groups but configure_optimizers() made"
            f" {len(live)}. Resume with the same optimizer set-up."
        )
    for group, loaded in zip(live, saved, strict=True):
        group.update({k: v for k, v in loaded.items() if k != "params"})
