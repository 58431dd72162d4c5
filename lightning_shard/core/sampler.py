"""The data position of a resumed or healed run: the ``DistributedSampler`` a door injects, made to start an
epoch at the batch the loop is at.

Lightning resumes a plain ``DataLoader`` mid-epoch from the epoch's first batch (its fetcher counts the batches
already taken, so the epoch still ends on time, having read its start twice and its end never). Where the
sampler is a plain ``DistributedSampler`` (the one Lightning injects for a loader with a random or sequential
sampler) the position is known: the epoch's order is ``seed + epoch``'s shuffle, and each batch of a standard
``BatchSampler`` takes the next ``batch_size`` indices. So the first pass after a restore skips the indices of
the batches taken, and every rank reads exactly what the uninterrupted run reads from there on.

A loader with a sampler of the user's own (Lightning wraps it in its ``DistributedSamplerWrapper``), a batch
sampler of its own, or an iterable dataset keeps Lightning's behaviour; a stateful loader (torchdata's
``StatefulDataLoader``) is restored by Lightning as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

log = logging.getLogger(__name__)

#: Where a restored loop is: ``(epoch, batches of that epoch already taken)``, or None when it starts afresh.
Position = Callable[[], "tuple[int, int] | None"]


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose next pass can start at a batch of an epoch: set by :meth:`resume_at`,
    or read from ``position`` when the pass starts (a loop restored from a checkpoint or a live replica group).

    The length stays the epoch's: the loop counts the batches it already took and ends the epoch on time."""

    def __init__(
        self, dataset: Any, *, batch_size: int, position: Position | None = None, **kwargs: Any
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size
        self.position = position
        #: The next pass's ``(epoch, batches to skip)``, set by :meth:`resume_at`.
        self._pending: tuple[int, int] | None = None
        self._ask_position = position is not None
        #: ``(epoch, batches skipped)`` of each pass that started mid-epoch.
        self.resumed: list[tuple[int, int]] = []

    @classmethod
    def like(
        cls, sampler: DistributedSampler, batch_size: int, position: Position | None
    ) -> ResumableDistributedSampler:
        """This class with ``sampler``'s dataset, ranks, shuffle, seed and epoch."""
        made = cls(
            sampler.dataset,
            batch_size=batch_size,
            position=position,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        made.epoch = sampler.epoch
        return made

    def resume_at(self, epoch: int, batches: int) -> None:
        """Start the next pass at batch ``batches`` of epoch ``epoch`` (0-based counts, as the loop keeps them)."""
        if epoch < 0 or batches < 0:
            raise ValueError(f"resume_at(epoch={epoch}, batches={batches}): both must be >= 0.")
        self._pending = (epoch, batches)

    def arm(self, position: Position | None) -> None:
        """Ask ``position`` again at the next pass (a loader set up for another run)."""
        self.position, self._ask_position = position, position is not None

    def __iter__(self) -> Iterator[Any]:
        start = self._start()
        indices = super().__iter__()
        if start is None:
            return indices
        epoch, batches = start
        skipped = list(indices)[batches * self.batch_size :]
        self.resumed.append((epoch, batches))
        log.info(
            "Resuming the data of epoch %d at batch %d (rank %d of %d).",
            epoch,
            batches,
            self.rank,
            self.num_replicas,
        )
        return iter(skipped)

    def _start(self) -> tuple[int, int] | None:
        """The pass's ``(epoch, batches to skip)`` if it starts mid-epoch (its epoch then set), else None."""
        pending, self._pending = self._pending, None
        asked, self._ask_position = self._ask_position, False  # only the first pass after set-up
        if pending is None and asked:
            assert self.position is not None
            pending = self.position()
            if pending is not None and pending[1] * self.batch_size >= self.num_samples:
                return None  # a checkpoint that closed its epoch: the loop moves on to the next one itself
        if pending is None or pending[1] <= 0:
            return None
        self.epoch = pending[0]
        return pending


def positionable(dataloader: object) -> DistributedSampler | None:
    """``dataloader``'s sampler if its position can be set: a plain ``DistributedSampler`` (or one of ours)
    under a standard ``BatchSampler`` of a loader without state of its own; else None."""
    if not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
        return None
    if callable(getattr(dataloader, "state_dict", None)) and callable(
        getattr(dataloader, "load_state_dict", None)
    ):
        return None  # a stateful loader (torchdata's StatefulDataLoader): Lightning restores its own position
    sampler = dataloader.sampler
    if type(sampler) is DistributedSampler or isinstance(sampler, ResumableDistributedSampler):
        return sampler
    return None


def make_resumable(
    dataloader: object, position: Position | None, rebuild: Callable[[DataLoader, Any], Any]
) -> object:
    """``dataloader`` with a :class:`ResumableDistributedSampler` in place of its plain ``DistributedSampler``
    (``rebuild(dataloader, sampler)``: the door's way of re-making a loader around a sampler, the one it used
    to inject the ``DistributedSampler``); a loader already holding one asks ``position`` again."""
    sampler = positionable(dataloader)
    if sampler is None:
        return dataloader
    assert isinstance(dataloader, DataLoader) and dataloader.batch_size is not None
    if isinstance(sampler, ResumableDistributedSampler):
        sampler.arm(position)
        return dataloader
    return rebuild(dataloader, ResumableDistributedSampler.like(sampler, dataloader.batch_size, position))
