"""A Fabric loop's loaders, positioned where its state says (after ``fabric.load`` or a heal from a live replica
group): :mod:`lightning_shard.core.sampler`."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.data import _update_dataloader

from lightning_shard.core.sampler import ResumableDistributedSampler, make_resumable, positionable


def position_loader(strategy: Any, dataloader: Any) -> Any:
    """``ShardFabricStrategy.process_dataloader``: a plain ``DistributedSampler`` (the one
    ``fabric.setup_dataloaders`` injected) made a :class:`~lightning_shard.core.sampler.ResumableDistributedSampler`,
    positioned by :func:`resume_dataloader`."""
    return make_resumable(dataloader, None, _update_dataloader)


def resume_dataloader(strategy: Any, dataloader: Any, epoch: int, batch: int) -> None:
    """Start ``dataloader``'s next pass at batch ``batch`` of epoch ``epoch`` (both from 0, as the loop
    counts them): every rank then reads what it would have read there, with that epoch's shuffle. Call it
    after ``fabric.load`` or ``join_replica_groups``, with the position the loop's state holds; the passes
    after it are epochs ``epoch + 1``, ... A loader not set up by ``fabric.setup_dataloaders`` with
    Fabric's own ``DistributedSampler`` (a sampler or batch sampler of the user's own, an iterable dataset)
    is refused."""
    inner = getattr(dataloader, "_dataloader", dataloader)  # Fabric's wrapper around the DataLoader
    sampler = positionable(inner)
    if not isinstance(sampler, ResumableDistributedSampler):
        raise ValueError(
            f"{type(strategy).__name__}.resume_dataloader: this loader's position cannot be set (sampler"
            f" {type(getattr(inner, 'sampler', None)).__name__}, batch sampler"
            f" {type(getattr(inner, 'batch_sampler', None)).__name__}). It needs a loader from"
            " fabric.setup_dataloaders(..., use_distributed_sampler=True) over a map-style dataset with a"
            " batch_size (no sampler or batch_sampler of one's own). Otherwise skip the batches already read"
            " in the loop, or use a stateful loader (torchdata's StatefulDataLoader) saved in the state."
        )
    sampler.resume_at(epoch, batch)
    if hasattr(dataloader, "_num_iter_calls"):  # Fabric sets the sampler's epoch to its count of passes
        dataloader._num_iter_calls = epoch
