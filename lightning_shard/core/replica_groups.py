"""The replica group both doors join under ``fault_tolerance``: one torchft Manager per process, kept for
every fit or Fabric set-up of the process (a second one would heartbeat beside the first and publish its
address under the same store key) and left at exit, as the process groups are; attached to each set-up
model and its optimizers, through what the session's engine offers (:meth:`~lightning_shard.engines.Engine.replica_sync`)."""

from __future__ import annotations

import atexit
from typing import Any

from torch.optim import Optimizer

from lightning_shard.core.session import Session
from lightning_shard.fault_tolerance.replicas import ReplicaGroups

_LIVE: list[ReplicaGroups] = []


def join_replica_groups(strategy: Any, session: Session, optimizers: list[Optimizer]) -> ReplicaGroups:
    """This process's :class:`ReplicaGroups` for ``strategy``'s flags, averaging the session's model's gradients
    over the groups after the engine's own reduction inside the group (DDP's buckets first over the group's
    ranks, stages 0-1), and reading the optimizer state the engine keeps in a layout of its own."""
    ft = strategy.config.fault_tolerance
    if _LIVE and _LIVE[0].ft != ft:
        _LIVE.pop().shutdown()
    if not _LIVE:
        _LIVE.append(ReplicaGroups(ft, strategy.global_rank, strategy.world_size))
        atexit.register(_LIVE[0].shutdown)
    replicas = _LIVE[0]
    sync = session.replica_sync()
    replicas.attach(session.model, optimizers, within=sync.within, own_state=sync.own_state)
    session.replicas = replicas  # the session's commit gate and checkpoint writer read it
    return replicas
