"""The Trainer door's process side: the core's :class:`~lightning_shard.core.process_groups.ProcessGroups` over
Lightning's Trainer ``ParallelStrategy``, with Lightning's Trainer script launcher (ranks reaped at exit)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_shard.core.process_groups import ProcessGroups, reduce_tensor
from lightning_shard.core.processes import ReapChildren, guarded
from lightning_shard.trainer import _compat as trainer_compat


class TrainerLauncher(ReapChildren, trainer_compat.SubprocessScriptLauncher):  # type: ignore[misc,valid-type]
    """Lightning's Trainer script launcher; rank 0 reaps the ranks it started when it exits."""


class ProcessGroupStrategy(ProcessGroups, ParallelStrategy):
    """The core's process side, under the Trainer's strategy base class."""

    launcher_class = TrainerLauncher

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: a custom strategy must say so to get a DistributedSampler.
        return True

    @override
    @guarded
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        return reduce_tensor(tensor, group, reduce_op)
