"""``ShardStrategy(fault_tolerance=...)`` in the Trainer: the replica group's quorum joined right after Lightning
restores a checkpoint (so a group started with ``ckpt_path`` offers, or is healed over, its restored state), the
Trainer's state a restarted group heals from, the commit gate around each optimizer step, and the logging.

A healed group receives everything a checkpoint would give: model and optimizer shards
(:class:`~lightning_shard.fault_tolerance.replicas.ReplicaGroups`), and here the loops (epoch, global step, batch
position), the callbacks' state (``ModelCheckpoint``'s best, an EMA's weights), the LR schedulers, the precision
plugin's state (the loss scaler) and the random generators. They are restored through Lightning's own
checkpoint restore, so the loop continues as after ``fit(ckpt_path=...)`` at the peer's step.
"""

from __future__ import annotations

import atexit
import random
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer import call

from lightning_shard.engines._shm import allreduce_hook
from lightning_shard.engines._whole_matrix import whole_matrix_step
from lightning_shard.fault_tolerance.replicas import ReplicaGroups


def _rng() -> dict[str, Any]:
    numpy: Any = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy[0], torch.from_numpy(numpy[1].astype(np.int64)), *numpy[2:]],
    }


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = state["numpy"]
    np.random.set_state((numpy[0], numpy[1].numpy().astype(np.uint32), *numpy[2:]))


def _trainer_state(trainer: L.Trainer) -> dict[str, Any]:
    connector = trainer._checkpoint_connector
    plugin = trainer.precision_plugin
    return {
        "pytorch-lightning_version": L.__version__,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "loops": connector._get_loops_state_dict(),
        "callbacks": call._call_callbacks_state_dict(trainer),
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        type(plugin).__qualname__: plugin.state_dict(),
        "rng": _rng(),
    }


#: The process's replica group: one Manager for every fit of the process (a second one would heartbeat beside
#: the first and publish its address under the same store key), left at exit as the process groups are.
_LIVE: list[ReplicaGroups] = []


def start(strategy: Any, trainer: L.Trainer) -> ReplicaGroups:
    """This process's :class:`ReplicaGroups`, its first quorum of this fit joined when Lightning has restored
    any checkpoint."""
    connector = trainer._checkpoint_connector
    restore = connector.restore_training_state  # private Lightning API (docs/compatibility.md)

    def load_trainer_state(state: dict[str, Any]) -> None:
        connector._loaded_checkpoint = dict(state)
        connector.restore_callbacks()
        restore()
        connector._loaded_checkpoint = {}
        _set_rng(state["rng"])

    for optimizer in strategy.optimizers:
        if whole_matrix_step(optimizer) is not None:
            raise ValueError(
                f"ShardStrategy(fault_tolerance=..., stage={strategy.config.stage}) cannot yet heal"
                f" {type(optimizer).__name__}, whose state each matrix's owner keeps whole (docs/optimizers.md)."
                " Use stage=0 or 1 with it, or an elementwise optimizer."
            )
    ft = strategy.config.fault_tolerance
    if _LIVE and _LIVE[0].ft != ft:
        _LIVE.pop().shutdown()
    if not _LIVE:
        _LIVE.append(ReplicaGroups(ft, strategy.global_rank, strategy.world_size))
        atexit.register(_LIVE[0].shutdown)
    replicas = _LIVE[0]
    replicas.extra_state, replicas.load_extra = (lambda: _trainer_state(trainer)), load_trainer_state
    replicas.attach(strategy.model, strategy.optimizers, within=allreduce_hook)

    def restore_then_join() -> None:
        restore()
        replicas.join()
        connector.restore_training_state = restore  # type: ignore[method-assign]  # once per fit

    connector.restore_training_state = restore_then_join  # type: ignore[method-assign]
    return replicas


def step(
    strategy: Any, replicas: ReplicaGroups, optimizer: Any, closure: Any, model: Any, **kwargs: Any
) -> Any:
    """The Trainer's optimizer step under fault tolerance: taken only if it commits on every participating
    group (else discarded, its gradients dropped), then logged."""
    result = replicas.step(closure, lambda run: strategy._optimizer_step(optimizer, run, model, **kwargs))
    log_step(replicas, strategy.lightning_module.trainer, strategy.is_global_zero)
    return result


def writes(replicas: ReplicaGroups | None) -> bool:
    """Whether this process writes checkpoints: always without fault tolerance, else in the lowest live group."""
    return replicas is None or replicas.writes_checkpoints()


def log_step(replicas: ReplicaGroups, trainer: L.Trainer, is_global_zero: bool) -> None:
    """``ft/participants``, ``ft/discarded_steps`` and (after a heal) ``ft/heal_seconds`` on each group's
    loggers."""
    if not is_global_zero or not replicas.participants:
        return
    metrics = {
        "ft/participants": float(replicas.participants[-1]),
        "ft/discarded_steps": float(replicas.discarded),
    }
    if replicas.heals:
        metrics["ft/heal_seconds"] = replicas.heals[-1]
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
