"""lightning_shard: large-model training for any LightningModule, by flag."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_shard._compat import build_per_environment
from lightning_shard.core.registry import LazyClass, register_names

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "CheckpointLoadError",
    "CollectiveTimeoutError",
    "EMA",
    "ExpertLoadMonitor",
    "InitWeightsError",
    "MFUMonitor",
    "RankReport",
    "RunSummary",
    "ShardConfig",
    "ShardFabricStrategy",
    "ShardPrecision",
    "ShardStrategy",
    "StragglerDetector",
    "ThroughputMonitorFlops",
    "dryrun",
]

# Imported on first use, so that ``import lightning_shard`` (and the Fabric door, the core, the engines and
# the capability packages under it) loads no Trainer code: ``from lightning_shard import ShardStrategy`` works
# as before.
_LAZY = {
    "ShardStrategy": "lightning_shard.trainer.strategy",
    "ShardPrecision": "lightning_shard.trainer.precision",
    "ShardFabricStrategy": "lightning_shard.fabric",
    "ShardConfig": "lightning_shard.config",
    "CheckpointLoadError": "lightning_shard.checkpoint",
    "InitWeightsError": "lightning_shard.checkpoint.init_weights",
    "CollectiveTimeoutError": "lightning_shard.core.processes",
    "ActivationCheckpointing": "lightning_shard.activation_checkpointing",
    "EMA": "lightning_shard.averaging",
    "ExpertLoadMonitor": "lightning_shard.callbacks",
    "MFUMonitor": "lightning_shard.callbacks",
    "RunSummary": "lightning_shard.callbacks",
    "StragglerDetector": "lightning_shard.callbacks",
    "ThroughputMonitorFlops": "lightning_shard.callbacks",
    "dryrun": "lightning_shard.dryrun",
    "RankReport": "lightning_shard.dryrun",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_shard' has no attribute {name!r}")


def _register_strategies() -> None:
    # The Trainer's registry is Lightning's own (``lightning.pytorch.strategies.StrategyRegistry``), imported
    # with it by ``import lightning``: registered there only once that module is loaded, without loading it.
    register_names(STRATEGY_REGISTRY, LazyClass("lightning_shard.fabric", "ShardFabricStrategy"))
    trainer_registry = sys.modules.get("lightning.pytorch.strategies")
    if trainer_registry is not None:
        register_names(
            trainer_registry.StrategyRegistry, LazyClass("lightning_shard.trainer.strategy", "ShardStrategy")
        )


_register_strategies()
build_per_environment()  # DeepSpeed's op builds: one folder per Python environment


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
