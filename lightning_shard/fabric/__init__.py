"""Lightning Fabric front door: :class:`ShardFabricStrategy`, over the engines ShardStrategy uses.

``L.Fabric(strategy=ShardFabricStrategy(stage=3))``, ``L.Fabric(strategy="zero3")`` or
``L.Fabric(strategy=ShardStrategy(stage=3).fabric())``. Modules: :mod:`.strategy` (flags, set-up, steps,
checkpoints), :mod:`lightning_shard.core.process_groups` (process groups, mesh, collectives), :mod:`._precision` (Fabric's precision
plugin over the precision policy), :mod:`._checkpoint` (a Fabric state as the Trainer strategy's checkpoint).
"""

from lightning_shard.fabric.strategy import ShardFabricStrategy

__all__ = ["ShardFabricStrategy"]
