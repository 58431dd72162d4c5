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

from typing import Any

import lightning as L
from lightning.pytorch.trainer import call

from lightning_shard.core.replica_groups import join_replica_groups
from lightning_shard.fault_tolerance._rng import rng_state, set_rng_state
from lightning_shard.fault_tolerance.replicas import ReplicaGroups


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
        "rng": rng_state(),
    }


def start(strategy: Any, trainer: L.Trainer) -> ReplicaGroups | None:
    """This process's :class:`ReplicaGroups`, its first quorum of this fit joined when Lightning has restored
    any checkpoint (None without ``fault_tolerance``)."""
    if strategy.config.fault_tolerance is None:
        return None
    connector = trainer._checkpoint_connector
    restore = connector.restore_training_state  # private Lightning API (docs/compatibility.md)

    def load_trainer_state(state: dict[str, Any]) -> None:
        connector._loaded_checkpoint = dict(state)
        connector.restore_callbacks()
        restore()
        connector._loaded_checkpoint = {}
        to_window_start(trainer)
        set_rng_state(state["rng"])

    replicas = join_replica_groups(strategy, strategy._session, strategy.optimizers)
    replicas.extra_state, replicas.load_extra = (lambda: _trainer_state(trainer)), load_trainer_state
    replicas.leaving = lambda: (
        strategy._preemption.agreed or 0 <= trainer.max_steps <= trainer.global_step + 1
    )

    def restore_then_join() -> None:
        restore()
        replicas.join()
        connector.restore_training_state = restore  # type: ignore[method-assign]  # once per fit

    connector.restore_training_state = restore_then_join  # type: ignore[method-assign]
    return replicas


def to_window_start(trainer: L.Trainer) -> None:
    """A healed group's loop moved back to the first micro-batch of the live groups' step.

    The quorum, and so the heal, is joined at the optimizer step, on a window's last micro-batch: the live
    groups hold the window's earlier micro-batches as local gradients, which a heal does not send. Started at
    the window's first batch, the healed group computes them again (with the same weights: they change only at
    a step) and its first step is the one the live groups take; the quorum it joined serves that step."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    back = progress.current.processed % trainer.accumulate_grad_batches  # type: ignore[attr-defined]
    for tracker in (progress.current, progress.total) if back else ():
        for field in ("ready", "started", "processed", "completed"):
            setattr(tracker, field, max(getattr(tracker, field) - back, 0))


def step(
    strategy: Any, replicas: ReplicaGroups, optimizer: Any, closure: Any, model: Any, **kwargs: Any
) -> Any:
    """The Trainer's optimizer step through the session's commit gate (discarded unless it commits on every
    participating group), then logged."""
    run = lambda closure: strategy._optimizer_step(optimizer, closure, model, **kwargs)  # noqa: E731
    result = strategy._session.gated(run, closure)
    log_step(replicas, strategy.lightning_module.trainer, strategy.is_global_zero)
    return result


def before_batch(replicas: ReplicaGroups | None) -> None:
    """Before a batch's forward: the quorum asked for after the last step settled (a peer's state readable)."""
    if replicas is not None:
        replicas.settle()


def end(replicas: ReplicaGroups | None) -> None:
    """The end of a fit: a peer healing over the quorum asked for after the last step gets this state."""
    if replicas is not None:
        replicas.release()


#: The checkpoint entry of ``semi_sync``'s outer state (last-sync copy, outer momentum, cycle position).
OUTER_KEY = "semi_sync"


def save_outer(replicas: ReplicaGroups | None, checkpoint: dict[str, Any]) -> None:
    """``semi_sync``: the outer state into ``checkpoint``, whole tensors (every rank of the writing group
    gathers its shards), so the run resumes exactly, on any rank layout."""
    if replicas is not None and replicas.outer is not None:
        checkpoint[OUTER_KEY] = replicas.outer.checkpoint_state()


def load_outer(replicas: ReplicaGroups | None, checkpoint: dict[str, Any]) -> None:
    """``semi_sync``: the outer state of a loaded checkpoint restored (a checkpoint without one, such as an
    every-step run's, starts a cycle from its weights)."""
    if replicas is not None and replicas.outer is not None and OUTER_KEY in checkpoint:
        replicas.outer.load_checkpoint_state(checkpoint[OUTER_KEY])


def log_step(replicas: ReplicaGroups, trainer: L.Trainer, is_global_zero: bool) -> None:
    """``ft/participants``, ``ft/discarded_steps``, (after a heal) ``ft/heal_seconds`` and (``semi_sync``)
    ``ft/outer_steps`` and ``ft/cross_group_bytes`` on each group's loggers."""
    metrics = replicas.metrics()
    if is_global_zero and metrics:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
