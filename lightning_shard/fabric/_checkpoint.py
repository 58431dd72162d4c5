"""``fabric.save`` / ``fabric.load`` in the Trainer strategy's on-disk format, written by the same engine.

Fabric hands the strategy a state such as ``{"model": model, "optimizer": optimizer, "step": 10}``. The
Trainer strategy's checkpoints hold the model under ``"state_dict"``, the optimizers as a list
(``"optimizer_states"``, in DCP as ``optimizer_0``, ``optimizer_1``, ...) and everything else beside them.
Here the Fabric state is mapped onto that layout (the model to ``"state_dict"``, optimizers in the order
the state names them, the rest as entries of their own), so one checkpoint directory is read by
``Trainer.fit(ckpt_path=...)`` and by ``fabric.load`` alike, and the engine writes and reads it as it does
for the Trainer (atomic commit, any world size and stage on load).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.fabric
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.storage import Location
from lightning_shard.core import Session

MODEL_ENTRY = "state_dict"
OPTIMIZERS_ENTRY = "optimizer_states"
#: The Trainer reads a checkpoint's Lightning version before anything else (its migrations).
VERSION_ENTRY = "pytorch-lightning_version"
#: Entries the engine fills and reads itself: never the user's.
_RESERVED = (MODEL_ENTRY, OPTIMIZERS_ENTRY, VERSION_ENTRY)


def refuse_save_options(storage_options: Any, filter: Any) -> None:
    if storage_options is not None or filter is not None:
        given = "storage_options" if storage_options is not None else "filter"
        raise TypeError(
            f"fabric.save(..., {given}=...) is not supported by ShardFabricStrategy: every rank writes its own"
            " shards with torch.distributed.checkpoint. Save the whole state, without it."
        )


def as_state(state: Any) -> dict[str, Any]:
    """``fabric.load``'s state as a dict (a bare module is ``{"model": module}``); refused when empty."""
    if isinstance(state, nn.Module):
        state = {"model": state}
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"ShardFabricStrategy loads into the set-up model: got fabric.load(path, state={state!r}). Pass"
            " state={'model': model, 'optimizer': optimizer, ...}."
        )
    return state


def save(
    session: Session, parts: tuple[str, list[tuple[str, Optimizer]], dict[str, Any]], location: Location
) -> None:
    """The state's parts (:func:`split_state`) written by the session's engine in the Trainer's layout."""
    _, optimizers, others = parts
    checkpoint = to_checkpoint(
        session.model_state(), [session.optimizer_state(optimizer) for _, optimizer in optimizers], others
    )
    session.save([optimizer for _, optimizer in optimizers], checkpoint, location)


def load(
    session: Session, state: dict[str, Any], location: Location, weights_only: bool | None, strict: bool
) -> dict[str, Any]:
    """The checkpoint at ``location`` read into the state's model, optimizers and other entries by the session's
    engine; what the state did not ask for is returned."""
    _, optimizers, others = split_state(state, session.model)
    optimizer_list = [optimizer for _, optimizer in optimizers]
    loaded = session.load(optimizer_list, location, weights_only, "ShardFabricStrategy", "fabric.load(path)")
    return restore_entries(state, others, loaded, strict)


def split_state(
    state: dict[str, Any], model: nn.Module
) -> tuple[str, list[tuple[str, Optimizer]], dict[str, Any]]:
    """``(model key, [(optimizer key, optimizer)], other entries)`` of a Fabric state holding ``model``."""
    modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
    if len(modules) != 1 or state[modules[0]] is not model:
        found = ", ".join(repr(k) for k in modules) or "none"
        raise ValueError(
            "ShardFabricStrategy saves and loads exactly one model per checkpoint: the one set up with"
            f" fabric.setup(...) (modules in the state: {found}). Pass state={{'model': model, 'optimizer':"
            " optimizer, ...}} with that model, and save other models to checkpoints of their own."
        )
    optimizers = [(key, obj) for key, obj in state.items() if is_optimizer(obj)]
    others = {key: obj for key, obj in state.items() if key != modules[0] and not is_optimizer(obj)}
    clash = sorted(set(others) & set(_RESERVED))
    if clash:
        raise ValueError(
            f"ShardFabricStrategy checkpoints keep the model and optimizers under {', '.join(_RESERVED)}: the state"
            f" key(s) {', '.join(repr(k) for k in clash)} would overwrite them. Rename those entries."
        )
    return modules[0], optimizers, others


def is_optimizer(obj: Any) -> bool:
    """A torch optimizer, or the one the DeepSpeed engine hands Fabric (DeepSpeed's ZeRO optimizers derive from
    its own base, not torch's), as Fabric's DeepSpeedStrategy counts them."""
    if isinstance(obj, Optimizer):
        return True
    base = sys.modules.get("deepspeed.runtime.base_optimizer")  # loaded where the DeepSpeed engine runs
    return base is not None and isinstance(obj, base.DeepSpeedOptimizer)


def to_checkpoint(
    model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], others: dict[str, Any]
) -> dict[str, Any]:
    """The Trainer's checkpoint dict: model and optimizer state plus the other entries, as saved."""
    checkpoint = {key: obj.state_dict() if isinstance(obj, _Stateful) else obj for key, obj in others.items()}
    checkpoint[MODEL_ENTRY] = model_state
    checkpoint[OPTIMIZERS_ENTRY] = optimizer_states
    checkpoint[VERSION_ENTRY] = lightning.fabric.__version__  # the release's (one version for both halves)
    return checkpoint


def restore_entries(
    state: dict[str, Any], others: dict[str, Any], loaded: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Fill the state's other entries from a loaded checkpoint; return what the state did not ask for."""
    remaining = {key: value for key, value in loaded.items() if key not in _RESERVED}
    missing = [key for key in others if key not in remaining]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint"
            f" (it has {', '.join(repr(k) for k in sorted(remaining)) or 'no other entries'}). Pass strict=False"
            " to fabric.load to skip it."
        )
    for key, obj in others.items():
        if key not in remaining:
            continue
        value = remaining.pop(key)
        if isinstance(obj, _Stateful):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return remaining
