"""The Fabric door's process side: the core's :class:`~lightning_shard.core.process_groups.ProcessGroups` over
Fabric's ``ParallelStrategy``, with Fabric's script launcher (ranks reaped at exit, as under the Trainer).

The groups live until interpreter exit (Fabric has no end-of-run hook), when they are released with every
other strategy's (:mod:`lightning_shard.core.processes`)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_shard.core.process_groups import ProcessGroups, reduce_tensor
from lightning_shard.core.processes import ReapChildren, guarded


class FabricLauncher(ReapChildren, _SubprocessScriptLauncher):
    """Fabric's script launcher; rank 0 reaps the ranks it started when it exits."""


class FabricProcesses(ProcessGroups, ParallelStrategy):
    """The core's process side, under Fabric's strategy base class."""

    launcher_class = FabricLauncher

    @override
    @guarded
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> Tensor | Any:
        return reduce_tensor(tensor, group, reduce_op)
