"""The replica group both doors join under ``fault_tolerance``: one torchft Manager per process, kept for
every fit or Fabric set-up of the process (a second one would heartbeat beside the first and publish its
address under the same store key) and left at exit, as the process groups are; attached to each set-up
model and its optimizers."""

from __future__ import annotations

import atexit
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard.engines._shm import allreduce_hook
from lightning_shard.engines._whole_matrix import (
    load_optimizer_state_dict,
    optimizer_state_dict,
    whole_matrix_step,
)
from lightning_shard.fault_tolerance.replicas import ReplicaGroups

_LIVE: list[ReplicaGroups] = []


def join_replica_groups(
    strategy: Any, model: nn.Module, optimizers: list[Optimizer], owner: str
) -> ReplicaGroups:
    """This process's :class:`ReplicaGroups` for ``strategy``'s flags, averaging ``model``'s gradients over
    the groups (DDP's buckets first over the group's ranks through shared memory, stages 0-1)."""
    ft = strategy.config.fault_tolerance
    if _LIVE and _LIVE[0].ft != ft:
        _LIVE.pop().shutdown()
    if not _LIVE:
        _LIVE.append(ReplicaGroups(ft, strategy.global_rank, strategy.world_size))
        atexit.register(_LIVE[0].shutdown)
    replicas = _LIVE[0]
    replicas.attach(model, optimizers, within=allreduce_hook, own_state=_WholeMatrixState(model))
    return replicas


class _WholeMatrixState:
    """A whole-matrix optimizer's state (stages 2-3, tensor parallelism): each matrix's entry on its owner, by
    name. Rank ``r`` of every group owns the same matrices, so a peer's entries are this rank's to hold."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def holds(self, optimizer: Optimizer) -> bool:
        return whole_matrix_step(optimizer) is not None

    def state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.model, optimizer, full=False)

    def load(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        load_optimizer_state_dict(self.model, optimizer, state)
