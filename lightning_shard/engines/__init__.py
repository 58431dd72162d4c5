"""Sharding engines behind one contract (:class:`~lightning_shard.engines.base.Engine`).

==========  ========================================================  ==============================
engine      stages                                                    module
==========  ========================================================  ==============================
``fsdp``    DDP (0), DDP + ZeroRedundancyOptimizer (1), FSDP2 (2, 3)  :mod:`.fsdp`
``deepspeed``  DeepSpeed ZeRO 0-3, CPU-Adam, NVMe (ZeRO-Infinity)     :mod:`.deepspeed`
==========  ========================================================  ==============================

``ShardConfig.engine`` names one; :func:`engine_class` is the only place that maps the name to the
class, so the strategy never names an engine.
"""

from __future__ import annotations

import importlib

from lightning_shard.engines.base import Engine, ReplicaSync, RunContext, StateBytes, TrainSettings

_ENGINES = {
    "fsdp": "lightning_shard.engines.fsdp:FSDPEngine",
    "deepspeed": "lightning_shard.engines.deepspeed:DeepSpeedEngine",
}


def engine_class(name: str) -> type[Engine]:
    """The engine class registered under ``name`` (imported only when chosen: DeepSpeed is optional)."""
    module, _, cls = _ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["Engine", "ReplicaSync", "RunContext", "StateBytes", "TrainSettings", "engine_class"]
