"""Optimizer state keyed by parameter name, each entry held by one rank (ZeRO-1's owners, whole-matrix owners).

The layout is the one ``get_optimizer_state_dict`` gives at stages 2-3: ``{"state": {name: {field: value}},
"param_groups": [{hyperparameters, "params": [names]}]}``, so one checkpoint format serves every stage and world
size. These are the parts that do not depend on who holds what.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
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


# --- nested entries ----------------------------------------------------------------------------------------
#
# An optimizer may keep a parameter's state nested (heavyball: ``{0: {"step": t, "Q": [t, t], "is_initialized":
# {0, 2}}}``). A sharded checkpoint reads back only what its metadata names, one level deep, so a nested entry is
# saved flat: each tensor under its path (``"0/Q/1"``), and the containers and plain values as a JSON skeleton
# in a uint8 tensor (``STRUCTURE``): no pickle is written or read. A flat entry is saved as it is.

STRUCTURE = "__structure__"


def flattened(entry: dict[Any, Any]) -> dict[str, Any]:
    """``entry`` as flat fields (itself when nothing in it is nested)."""
    if not any(isinstance(v, (dict, list, tuple, set)) for v in entry.values()):
        return entry
    leaves: dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {"dict": [[k, walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, set):
            return {"set": sorted(value)}
        if torch.is_tensor(value):
            leaves[path.lstrip("/")] = value
            return {"tensor": path.lstrip("/")}
        return {"value": value}

    skeleton = json.dumps(walk(entry, ""))
    leaves[STRUCTURE] = torch.tensor(list(skeleton.encode()), dtype=torch.uint8)
    return leaves


def nested(fields: dict[str, Any]) -> dict[Any, Any]:
    """The entry :func:`flattened` made ``fields`` from (``fields`` itself when it was flat)."""
    if STRUCTURE not in fields:
        return fields

    def build(spec: dict[str, Any]) -> Any:
        ((kind, body),) = spec.items()
        if kind == "dict":
            return {k: build(v) for k, v in body}
        if kind in ("list", "tuple"):
            items = [build(v) for v in body]
            return items if kind == "list" else tuple(items)
        if kind == "set":
            return set(body)
        return fields[body] if kind == "tensor" else body

    out: dict[Any, Any] = build(json.loads(bytes(fields[STRUCTURE].tolist()).decode()))
    return out


def copied_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor of more than one element on ``device`` (scalars, e.g. Adam's ``step``, stay
    where torch keeps them), copied; containers rebuilt."""
    if torch.is_tensor(value):
        return value.detach().to(device, copy=True) if value.dim() > 0 else value.detach().clone()
    if isinstance(value, dict):
        return {k: copied_to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied_to(v, device) for v in value)
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (nested dicts, lists, tuples)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []
