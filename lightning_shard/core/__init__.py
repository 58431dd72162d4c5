"""The door-neutral core both front doors stand on: the process side (:mod:`.processes`), the one
function that prepares a module for a run (:mod:`.transform`) and the session it returns (:mod:`.session`),
which both doors hold, and what both doors' precision plugins share (:mod:`.precision`). Nothing here imports
``lightning.pytorch`` or a door; the Trainer door (:mod:`lightning_shard.trainer`) and the Fabric door
(:mod:`lightning_shard.fabric`) are thin adapters from their framework's hooks to it."""

from lightning_shard.core import transform
from lightning_shard.core.process_groups import ProcessGroups
from lightning_shard.core.processes import CollectiveTimeoutError, guarded
from lightning_shard.core.session import Session
from lightning_shard.core.transform import prepare, prepare_precision

__all__ = [
    "CollectiveTimeoutError",
    "ProcessGroups",
    "Session",
    "guarded",
    "prepare",
    "prepare_precision",
    "transform",
]
