"""One rank of a large world, played in this process: torch's fake process group and the process side
``prepare`` reads.

The fake group answers every collective at once without sending anything, so the layout's meshes, tensor
and expert parallelism, the pipeline cut and FSDP2's sharding are built exactly as rank ``r`` of ``N`` builds
them. :class:`FakeWorld` is the strategy's own process side (:class:`~lightning_shard.core.process_groups.
ProcessGroups`) with the rank, the world size and the meta device filled in by hand, and no timeouts or
barriers (nobody else is there to wait for).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_shard import _compat
from lightning_shard.config import ShardConfig
from lightning_shard.core.process_groups import ProcessGroups, parallel_dims
from lightning_shard.parallel import ParallelDims


class FakeWorld(ProcessGroups):
    """Rank ``rank`` of ``world_size``, its parameters on the meta device (nothing is allocated), or on
    ``device`` (the CPU under fake tensors, for a traced step)."""

    def __init__(self, config: ShardConfig, rank: int, world_size: int, device: str = "meta") -> None:
        self.config = config
        super().__init__()
        self.global_rank, self.world_size = rank, world_size
        self.local_rank = self.node_rank = 0
        self.parallel_devices = [torch.device(device)]
        self.cluster_environment = None
        self._process_group_backend = "fake"

    @property
    def dims(self) -> ParallelDims:
        return parallel_dims(self.config, self.world_size)

    def build_meshes(self) -> None:
        """Every mesh of the layout on the fake group (the collective every rank runs at set-up)."""
        self._meshes = self.dims.build("cpu")
        self._context_parallel = self._build_context_parallel(self._meshes.context)

    def apply_timeout(self) -> None:
        """Nothing to wait for: the fake group never blocks."""

    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for: the fake group never blocks."""


@contextmanager
def fake_rank(rank: int, world_size: int) -> Generator[None, None, None]:
    """The default group as rank ``rank`` of ``world_size`` (fake), destroyed on the way out with every group
    made under it."""
    if dist.is_initialized():
        raise RuntimeError(
            "dryrun() plays each rank on a fake process group of its own, but this process already has a"
            " default process group. Run the dry run in a process without one (before the Trainer starts)."
        )
    _compat.init_fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_of(dims: ParallelDims, **place: int) -> int:
    """The global rank at ``place`` (``pp replicate shard cp tp``; the rest 0): the inverse of
    :meth:`ParallelDims.coordinates`."""
    at: dict[str, Any] = {"pp": 0, "replicate": 0, "shard": 0, "cp": 0, "tp": 0, **place}
    rank = at["pp"]
    for name, size in (
        ("replicate", dims.replicate),
        ("shard", dims.shard),
        ("cp", dims.cp),
        ("tp", dims.tp),
    ):
        rank = rank * size + at[name]
    return int(rank)


def default_ranks(dims: ParallelDims) -> list[int]:
    """The first and last rank, and one rank of each distinct place: each pipeline stage, each expert block
    (the ``ep`` coordinate, on the first stage)."""
    ranks = {0, dims.world_size - 1}
    ranks.update(rank_of(dims, pp=stage) for stage in range(dims.pp))
    for ep in range(dims.ep):
        ranks.add(rank_of(dims, shard=ep // dims.cp, cp=ep % dims.cp))
    return sorted(ranks)
