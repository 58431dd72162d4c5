"""Expert parallelism under the FSDP engine: each rank's expert blocks, sharded (stages 2-3), replicated
(stage 0) or partitioned for the optimizer (stage 1) over the ranks that hold the same block.

:mod:`lightning_shard.expert_parallel` has split the experts before the wrap (each rank keeps ``E/ep`` whole
experts); what changes for the engine is the group each block is data-parallel over: the expert data-parallel
view of the run's meshes, not the dense layers' group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard.engines.base import RunContext
from lightning_shard.engines.fsdp.zero import ExpertBlocks
from lightning_shard.expert_parallel import expert_modules

#: The experts modules, and the mesh their blocks are sharded or replicated over.
Experts = tuple[list[nn.Module], Any]


def experts_of(module: nn.Module, run: RunContext) -> Experts | None:
    """The experts modules and their data-parallel mesh (None without expert parallelism)."""
    if not run.dims.ep_enabled:
        return None
    assert run.meshes is not None
    return expert_modules(module), run.meshes.expert_data_parallel


def replicate_experts(module: nn.Module, run: RunContext, replicate: Any, mp_policy: Any) -> None:
    """Stage 0: each expert block replicated over the ranks that hold it, before the rest of the module."""
    experts = experts_of(module, run)
    if experts is not None:
        for unit in experts[0]:
            replicate(unit, mesh=experts[1], mp_policy=mp_policy)


def expert_blocks(model: nn.Module, run: RunContext) -> ExpertBlocks | None:
    """Stage 1: the expert blocks, whose optimizer state is partitioned over the ranks holding the same block
    (the mesh stage 0 replicates them over), not the whole group."""
    experts = experts_of(model, run)
    if experts is None:
        return None
    assert run.meshes is not None
    modules, data = experts
    params = frozenset(p for module in modules for p in module.parameters())
    return ExpertBlocks(params, run.meshes.expert_parallel, data.get_group())
