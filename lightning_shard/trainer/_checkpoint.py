"""What ShardStrategy's checkpoint hooks add to the session's save and load: Lightning's side alone.

The session's engine writes and reads every kind (sharded DCP directories, one-file checkpoints, DeepSpeed's
directories, async saves), committed atomically by :mod:`lightning_shard.checkpoint`. Here: ``ckpt_path="last"``
found on an object store, who writes a save and whether it is the Trainer's exception checkpoint, the
``weights_only`` of the Trainer call, and the loaded state the hooks read under whole parameters.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_shard.checkpoint.storage import Remote, newest_last, resolve
from lightning_shard.engines import declared
from lightning_shard.trainer import _compat as trainer_compat
from lightning_shard.trainer import _fault_tolerance as fault_tolerance


def last_on_object_stores(strategy_class: type, trainer: Any) -> str | None:
    """``ckpt_path="last"`` under ``strategy_class`` (ShardStrategy) with a ModelCheckpoint on an object store."""
    if not isinstance(trainer.strategy, strategy_class):
        return None
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            directory = resolve(callback.dirpath, "ModelCheckpoint(dirpath)")
            found = newest_last(directory) if isinstance(directory, Remote) else None
            if found is not None:
                return str(found)
    return None


def interrupted(module: Any) -> bool:
    """A save while the Trainer is interrupted (OnExceptionCheckpoint, SIGTERM): committed before the job goes on
    to exit, not left to a background thread."""
    trainer = None if module is None else module.trainer
    return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED


def save_checkpoint(strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
    """``ShardStrategy.save_checkpoint``: nothing after a failed collective; with fault tolerance, only the group
    that writes (a group leaving on an exception writes its own); an exception's save committed before return."""
    if storage_options is not None:
        raise TypeError(
            "ShardStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP."
        )
    if strategy.refuse_write_after_failure(filepath):
        return
    exception = interrupted(strategy.lightning_module)
    if not (exception or strategy._writes_checkpoints()):  # a group leaving writes its own
        return
    fault_tolerance.save_outer(strategy._replicas, checkpoint)
    strategy._save_checkpoint(checkpoint, filepath, exception=exception)
    if exception:
        strategy._engines.wait_for_checkpoints()


def weights_only_given(module: Any) -> bool | None:
    """What the Trainer call was given: Lightning drops it for strategies that restore after set-up."""
    trainer = getattr(module, "_trainer", None)
    return getattr(trainer, trainer_compat.WEIGHTS_ONLY_ATTR, None)


def with_module_state(checkpoint: dict[str, Any], module: nn.Module, engine: str) -> dict[str, Any]:
    """Under whole parameters (the FSDP engine at stages 0-1, no tensor parallelism) the hooks that read the loaded
    model state (Lightning's WeightAveraging reads its averages back from it) get what DDPStrategy gives them, by
    the LightningModule's names. A sharded checkpoint keeps that state in its shards, and a one-file one was read
    by the DDP-wrapped names; either way it is in the module now."""
    whole = not any(isinstance(p, DTensor) for p in module.parameters())
    if declared(engine).module_state_after_load and whole:
        checkpoint["state_dict"] = module.state_dict()
    return checkpoint
