"""ResumableDistributedSampler and make_resumable in one process (no process group): a resumed pass is the
rest of the uninterrupted pass of its epoch, and only loaders whose position is known are touched."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from lightning.fabric.utilities.data import _update_dataloader
from lightning.fabric.wrappers import _FabricDataLoader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_shard import ShardFabricStrategy
from lightning_shard.core.sampler import ResumableDistributedSampler, make_resumable

#: 21 indices on 2 ranks: 11 each, the last one padded (10 each with drop_last), in batches of 3.
DATA = list(range(21))
BATCH = 3


def _reference(epoch: int, rank: int, seed: int, drop_last: bool) -> list[int]:
    """The uninterrupted pass of ``epoch`` on ``rank``: what a plain ``DistributedSampler`` yields."""
    sampler = DistributedSampler(
        DATA, num_replicas=2, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def _sampler(rank: int = 0, seed: int = 0, drop_last: bool = False, position: Any = None) -> Any:
    return ResumableDistributedSampler(
        DATA,
        batch_size=BATCH,
        position=position,
        num_replicas=2,
        rank=rank,
        shuffle=True,
        seed=seed,
        drop_last=drop_last,
    )


class _Counted:
    """A ``position`` callable that counts how often it is asked."""

    def __init__(self, answer: tuple[int, int] | None) -> None:
        self.answer, self.calls = answer, 0

    def __call__(self) -> tuple[int, int] | None:
        self.calls += 1
        return self.answer


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("epoch", "batches", "seed"), [(0, 1, 0), (2, 3, 7)])
def test_a_resumed_pass_is_the_rest_of_the_uninterrupted_pass_then_full_passes_again(
    epoch, batches, seed, rank, drop_last
):
    sampler = _sampler(rank, seed, drop_last)
    sampler.resume_at(epoch, batches)
    resumed = list(sampler)
    assert resumed == _reference(epoch, rank, seed, drop_last)[batches * BATCH :]
    assert resumed  # a real skip, not an empty pass
    assert sampler.epoch == epoch and sampler.resumed == [(epoch, batches)]
    sampler.set_epoch(epoch + 1)  # as the loops do before each pass
    assert list(sampler) == _reference(epoch + 1, rank, seed, drop_last)
    assert sampler.resumed == [(epoch, batches)]  # the resume applied once


def test_the_epochs_of_both_ranks_stay_disjoint_halves_after_a_resume():
    taken = {rank: _reference(1, rank, 3, True)[: 2 * BATCH] for rank in (0, 1)}
    rest = {}
    for rank in (0, 1):
        sampler = _sampler(rank, 3, True)
        sampler.resume_at(1, 2)
        rest[rank] = list(sampler)
    read = {rank: taken[rank] + rest[rank] for rank in (0, 1)}
    assert len(set(read[0])) == len(set(read[1])) == 10 and not set(read[0]) & set(read[1])


def test_position_is_asked_once_at_the_first_pass():
    position = _Counted((2, 1))
    sampler = _sampler(position=position)
    assert position.calls == 0  # asked when the pass starts, not at construction
    assert list(sampler) == _reference(2, 0, 0, False)[BATCH:]
    assert list(sampler) == _reference(2, 0, 0, False)  # the same epoch again (no set_epoch), in full
    sampler.set_epoch(3)
    assert list(sampler) == _reference(3, 0, 0, False)
    assert position.calls == 1 and sampler.resumed == [(2, 1)]


def test_a_position_of_none_means_a_full_pass():
    position = _Counted(None)
    sampler = _sampler(position=position)
    sampler.set_epoch(4)
    assert list(sampler) == _reference(4, 0, 0, False)
    list(sampler)
    assert position.calls == 1 and sampler.resumed == []


@pytest.mark.parametrize("batches", [0, 4, 9], ids=["no batch", "the epoch", "past the epoch"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_position_of_no_batch_or_of_the_whole_epoch_gives_a_full_pass(drop_last, batches):
    # 11 indices a rank (4 batches, the last short), 10 with drop_last: 4 batches skip 12 >= either. The
    # Trainer's loop moves on to the next epoch itself when its checkpoint closed one.
    position = _Counted((1, batches))
    sampler = _sampler(drop_last=drop_last, position=position)
    sampler.set_epoch(1)
    assert list(sampler) == _reference(1, 0, 0, drop_last)
    assert position.calls == 1 and sampler.resumed == []


def test_a_resume_at_no_batch_gives_a_full_pass():
    sampler = _sampler()
    sampler.resume_at(1, 0)
    sampler.set_epoch(1)
    assert list(sampler) == _reference(1, 0, 0, False) and sampler.resumed == []


def test_the_last_batch_of_an_epoch_can_be_the_whole_resumed_pass():
    sampler = _sampler()
    sampler.resume_at(0, 3)  # 9 of 11 indices taken: the pass is the short last batch
    assert list(sampler) == _reference(0, 0, 0, False)[9:]
    assert len(_reference(0, 0, 0, False)) == 11 and sampler.resumed == [(0, 3)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_length_stays_the_epochs(drop_last):
    sampler = _sampler(drop_last=drop_last, position=_Counted((0, 2)))
    epoch = len(_reference(0, 0, 0, drop_last))
    loader = DataLoader(DATA, batch_size=BATCH, sampler=sampler)
    batches = len(loader)
    assert len(sampler) == epoch
    assert len(list(loader)) == batches - 2  # the pass is shorter: the loop counts the batches it took
    assert len(sampler) == epoch and len(loader) == batches
    sampler.resume_at(0, 1)
    assert len(sampler) == epoch and len(loader) == batches


@pytest.mark.parametrize(
    ("epoch", "batches", "match"),
    [
        (-1, 0, r"resume_at\(epoch=-1, batches=0\): both must be >= 0"),
        (0, -2, r"resume_at\(epoch=0, batches=-2\): both must be >= 0"),
    ],
    ids=["epoch", "batches"],
)
def test_a_negative_position_is_refused(epoch, batches, match):
    sampler = _sampler()
    with pytest.raises(ValueError, match=match):
        sampler.resume_at(epoch, batches)
    assert list(sampler) == _reference(0, 0, 0, False)  # nothing was set


class _OwnSampler(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class _OwnBatchSampler(BatchSampler):
    pass


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


def _distributed(**kwargs: Any) -> DistributedSampler:
    return DistributedSampler(DATA, num_replicas=2, rank=0, **kwargs)


def _not_rebuilt(dataloader: Any, sampler: Any) -> Any:
    raise AssertionError("this loader must be left as it is")


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=2, sampler=_OwnSampler(21)),
        lambda: DataLoader(
            DATA, batch_sampler=_OwnBatchSampler(_distributed(), batch_size=2, drop_last=False)
        ),
        lambda: DataLoader(DATA, batch_sampler=BatchSampler(_distributed(), batch_size=2, drop_last=False)),
        lambda: DataLoader(_Stream(), batch_size=2),
        lambda: DataLoader(DATA, batch_size=None, sampler=_distributed()),
        lambda: DATA,
    ],
    ids=[
        "own sampler",
        "own batch sampler",
        "batch sampler given",
        "iterable dataset",
        "batch_size=None",
        "not a loader",
    ],
)
def test_make_resumable_leaves_a_loader_of_unknown_position_alone(make):
    dataloader = make()
    sampler = getattr(dataloader, "sampler", None)
    assert make_resumable(dataloader, _Counted((0, 1)), _not_rebuilt) is dataloader
    assert getattr(dataloader, "sampler", None) is sampler


def test_make_resumable_replaces_a_plain_distributed_sampler_keeping_its_settings():
    plain = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=False, seed=5, drop_last=True)
    plain.set_epoch(3)
    dataloader = DataLoader(DATA, batch_size=BATCH, sampler=plain, drop_last=True)
    position = _Counted(None)
    made = make_resumable(dataloader, position, _update_dataloader)
    assert isinstance(made, DataLoader) and made is not dataloader
    sampler = made.sampler
    assert type(sampler) is ResumableDistributedSampler and sampler is made.batch_sampler.sampler
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last) == (
        2,
        1,
        False,
        5,
        True,
    )
    assert sampler.epoch == 3 and sampler.batch_size == BATCH and sampler.position is position
    assert made.batch_size == BATCH and made.drop_last
    assert list(sampler) == list(plain) and position.calls == 1


def test_make_resumable_rearms_a_loader_that_already_holds_one():
    first = _Counted((0, 1))
    dataloader = make_resumable(
        DataLoader(DATA, batch_size=BATCH, sampler=_distributed(shuffle=True)), first, _update_dataloader
    )
    sampler = dataloader.sampler
    list(sampler)
    again = _Counted((1, 2))
    assert make_resumable(dataloader, again, _not_rebuilt) is dataloader
    assert dataloader.sampler is sampler
    assert list(sampler) == _reference(1, 0, 0, False)[2 * BATCH :]
    assert (first.calls, again.calls) == (1, 1)
    assert sampler.resumed == [(0, 1), (1, 2)]


def test_fabrics_resume_dataloader_positions_the_set_up_loader_and_its_pass_count():
    strategy = ShardFabricStrategy(stage=3)
    plain = DataLoader(DATA, batch_size=BATCH, sampler=_distributed(shuffle=True))
    loader = _FabricDataLoader(strategy.process_dataloader(plain))
    assert type(loader._dataloader.sampler) is ResumableDistributedSampler
    strategy.resume_dataloader(loader, epoch=2, batch=1)
    assert loader._num_iter_calls == 2
    rows = [int(i) for batch in loader for i in batch]
    assert rows == _reference(2, 0, 0, False)[BATCH:]
    assert [int(i) for batch in loader for i in batch] == _reference(3, 0, 0, False)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: DataLoader(DATA, batch_size=2, shuffle=True),
            r"sampler RandomSampler, batch sampler BatchSampler",
        ),
        (
            lambda: _FabricDataLoader(DataLoader(DATA, batch_size=2, sampler=_OwnSampler(21))),
            r"sampler _OwnSampler, batch sampler BatchSampler",
        ),
        (
            lambda: _FabricDataLoader(DataLoader(DATA, batch_size=2, sampler=_distributed())),
            r"sampler DistributedSampler, batch sampler BatchSampler",
        ),
        (lambda: _FabricDataLoader(DataLoader(_Stream(), batch_size=2)), r"sampler _InfiniteConstantSampler"),
        (lambda: DATA, r"sampler NoneType, batch sampler NoneType"),
    ],
    ids=["not set up", "own sampler", "plain sampler not set up", "iterable dataset", "not a loader"],
)
def test_fabrics_resume_dataloader_refuses_a_loader_it_cannot_position(make, match):
    with pytest.raises(
        ValueError,
        match=rf"ShardFabricStrategy.resume_dataloader: this loader's position cannot be set \({match}.*"
        r"fabric.setup_dataloaders\(\.\.\., use_distributed_sampler=True\)",
    ):
        ShardFabricStrategy(stage=3).resume_dataloader(make(), epoch=0, batch=1)
