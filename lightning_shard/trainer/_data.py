"""The Trainer's training loader, positioned where a restored loop is (a mid-epoch checkpoint, a healed replica
group): :mod:`lightning_shard.core.sampler`."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.data import _update_dataloader

from lightning_shard.core.sampler import Position, ResumableDistributedSampler, make_resumable
from lightning_shard.trainer._compat import injects_distributed_sampler

#: Lightning's warning for a mid-epoch resume of a loader without state: ours starts where the loop is.
_UNRESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


def loop_position(trainer: Any) -> Position:
    """Where ``trainer``'s fit loop is once restored: ``(epoch, batches taken)`` while its epoch loop restarts,
    read when the loader's first pass begins (after Lightning restored the loops), else None."""

    def position() -> tuple[int, int] | None:
        loop = trainer.fit_loop
        if not loop.epoch_loop.restarting:
            return None
        # ``processed``: the batches whose step ran (a checkpoint written in ``on_train_batch_end`` counts its
        # batch; one written during a step, or a heal at a step's quorum, does not), as the loop resumes.
        return loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.processed

    return position


def position_loader(strategy: Any, dataloader: object) -> object:
    """``ShardStrategy.process_dataloader``: the training loader's plain ``DistributedSampler`` (the one Lightning
    injected) made a :class:`~lightning_shard.core.sampler.ResumableDistributedSampler` that starts where the
    restored loop is; every other loader as Lightning made it."""
    module = strategy.lightning_module
    trainer = module.trainer if module is not None else None
    # With ``use_distributed_sampler=False`` the loader is the user's own: Lightning's behaviour, as promised.
    if trainer is None or not trainer.training or not injects_distributed_sampler(trainer):
        return dataloader
    dataloader = make_resumable(dataloader, loop_position(trainer), _update_dataloader)
    if isinstance(getattr(dataloader, "sampler", None), ResumableDistributedSampler):
        warnings.filterwarnings("ignore", message=_UNRESUMABLE)
    return dataloader
