"""The torch-native engine (``engine="fsdp"``): DDP, ZeroRedundancyOptimizer and FSDP2, one module per feature.

=================  ======================================================================================
module             what it holds
=================  ======================================================================================
``engine``         :class:`FSDPEngine`: the engine contract, each step handed to the modules below
``capabilities``   what the engine declares it serves (stages, dimensions, offload, checkpoint modes)
``sharding``       stages 2-3: which modules ``fully_shard`` wraps, and with what (``units``: packed blocks)
``zero``           stage 1: ``ZeroRedundancyOptimizer`` with name-keyed, reshardable state
=================  ======================================================================================
"""

from __future__ import annotations

from lightning_shard.engines.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
