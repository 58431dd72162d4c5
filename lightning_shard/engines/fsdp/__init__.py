"""The torch-native engine (``engine="fsdp"``): DDP, ZeroRedundancyOptimizer and FSDP2, one module per feature.

=================  ======================================================================================
module             what it holds
=================  ======================================================================================
``engine``         :class:`FSDPEngine`: the engine contract, each step handed to the modules below
``capabilities``   what the engine declares it serves (stages, dimensions, offload, checkpoint modes)
``sharding``       stages 2-3: which modules ``fully_shard`` wraps, and with what (``units``: packed blocks)
``zero``           stage 1: ``ZeroRedundancyOptimizer`` with name-keyed, reshardable state
``compression``    stages 0-1: DDP's gradient all-reduce hook, PowerSGD's state in checkpoints
``local_step``     elementwise optimizers stepped on the local shards of DTensor parameters
``whole_matrix``   optimizers stepped on whole matrices (Muon, SOAP) over sharded or split parameters
``experts``        expert parallelism: the expert blocks' own data-parallel mesh at every stage
``fp8``            the float8 all-gathers' scales, precomputed after each step and after new weights
``checkpoint``     one file or DCP's sharded directory, async writes, DeepSpeed's checkpoints read
``state``          state dicts keyed by parameter name at every stage
=================  ======================================================================================
"""

from __future__ import annotations

from lightning_shard.engines.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
