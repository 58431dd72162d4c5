"""lightning_shard: large-model training for any LightningModule, by flag."""

from __future__ import annotations

import importlib
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard.checkpoint import CheckpointLoadError
from lightning_shard.checkpoint.init_weights import InitWeightsError
from lightning_shard.config import ShardConfig
from lightning_shard.core.processes import CollectiveTimeoutError
from lightning_shard.core.registry import register_names
from lightning_shard.fabric import ShardFabricStrategy
from lightning_shard.precision import ShardPrecision
from lightning_shard.trainer.strategy import ShardStrategy

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "CheckpointLoadError",
    "CollectiveTimeoutError",
    "EMA",
    "InitWeightsError",
    "MFUMonitor",
    "RunSummary",
    "ShardConfig",
    "ShardFabricStrategy",
    "ShardPrecision",
    "ShardStrategy",
    "StragglerDetector",
    "ThroughputMonitorFlops",
]

_LAZY = {
    "ActivationCheckpointing": "lightning_shard.activation_checkpointing",
    "EMA": "lightning_shard.averaging",
    "MFUMonitor": "lightning_shard.callbacks",
    "RunSummary": "lightning_shard.callbacks",
    "StragglerDetector": "lightning_shard.callbacks",
    "ThroughputMonitorFlops": "lightning_shard.callbacks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_shard' has no attribute {name!r}")


def _register_strategies() -> None:
    register_names(StrategyRegistry, ShardStrategy)
    register_names(STRATEGY_REGISTRY, ShardFabricStrategy)


_register_strategies()
