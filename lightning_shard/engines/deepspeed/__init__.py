"""The DeepSpeed engine (``engine="deepspeed"``): ZeRO 0-3 through ``deepspeed.initialize``, one module per feature.

=================  ======================================================================================
module             what it holds
=================  ======================================================================================
``engine``         :class:`DeepSpeedEngine`: the engine contract over DeepSpeed's engine
``capabilities``   what the engine declares it serves (ZeRO 0-3, ZeRO-Offload, ZeRO-Infinity)
``config``         DeepSpeed's JSON config from the flags, the precision and the Trainer's settings
``precision``      DeepSpeed's precision rules (the policy's subclass, the precisions it refuses)
``ops``            DeepSpeed's compiled ops built ahead of a run (``lightning-shard build-ops``), CPU-Adam
``weights``        full weights into ``deepspeed.zero.Init``'s partitions
``offload``        ZeRO-Infinity's NVMe swap folder: made ready, measured, removed
``checkpoint``     DeepSpeed's per-rank checkpoints, committed as every other, and read back
``experts``        expert parallelism as DeepSpeed MoE parameters and groups
``whole_matrix``   optimizers stepped on whole matrices over ZeRO's flat partitions
=================  ======================================================================================

The package imports no optional dependency: DeepSpeed itself is imported where it is used.
"""

from __future__ import annotations

from lightning_shard.engines.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
