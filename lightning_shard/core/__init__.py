"""The door-neutral core both front doors stand on: the process side (:mod:`.processes`) and the one
function that prepares a module for a run (:mod:`.prepare`). Nothing here imports ``lightning.pytorch``
or a door; the Trainer door (:mod:`lightning_shard.trainer`) and the Fabric door
(:mod:`lightning_shard.fabric`) are thin adapters from their framework's hooks to it."""

from lightning_shard.core import transform
from lightning_shard.core.process_groups import ProcessGroups
from lightning_shard.core.processes import CollectiveTimeoutError, guarded
from lightning_shard.core.transform import Prepared, prepare, prepare_precision

__all__ = [
    "CollectiveTimeoutError",
    "Prepared",
    "ProcessGroups",
    "guarded",
    "prepare",
    "prepare_precision",
    "transform",
]
