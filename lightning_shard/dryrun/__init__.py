"""Dry runs at scale: a job's real shards for chosen ranks of its world, built on one CPU.

``dryrun(model, strategy, world_size)`` plays each chosen rank on torch's fake process group with the model on
the meta device, runs the strategy's own set-up (``core.transform.prepare``) and reports the rank's place, its
pipeline stage and layers, its experts, and the bytes of its parameters, gradients, optimizer state and
checkpoint files, read off the real shards (padding included), beside the planner's figures. See
docs/dryrun.md. Modules:

===================  ======================================================================
``world``            the fake group as one rank, the process side ``prepare`` reads, the default ranks
``models``           where the model comes from (a module, a class, a Hugging Face config, a published config)
``measure``          bytes held and written, from the shards
``optimizers``       the user's optimizers over the shards, one step on meta
``compare``          the planner's figures for the same flags
``trace``            one training step on fake tensors: its peak memory, the collectives the fake group receives
``report``           :class:`RankReport`, its JSON and table
``run``              :func:`dryrun`, the checks before anything is built
``checkpoint_plan``  a sharded checkpoint's DCP metadata and reads for every rank, from metadata only
``resharding``       :func:`reshard`: which files each rank of another layout reads from a checkpoint
``command``          ``lightning-shard dryrun``
===================  ======================================================================
"""

from __future__ import annotations

import sys
import types
from typing import Any

from lightning_shard.dryrun.models import PUBLISHED
from lightning_shard.dryrun.report import RankReport, table
from lightning_shard.dryrun.resharding import RankRead, ReshardPlan, reshard, reshard_table
from lightning_shard.dryrun.run import check_layout, dryrun, model_sizes
from lightning_shard.dryrun.world import default_ranks

__all__ = [
    "PUBLISHED",
    "RankRead",
    "RankReport",
    "ReshardPlan",
    "check_layout",
    "default_ranks",
    "dryrun",
    "model_sizes",
    "reshard",
    "reshard_table",
    "table",
]


class _CallablePackage(types.ModuleType):
    """``lightning_shard.dryrun(...)`` is the function even once this package is imported: importing a
    subpackage binds its name on the parent package, where the public function of the same name lives."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[RankReport]:
        return dryrun(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
