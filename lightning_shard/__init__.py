"""lightning_shard: large-model training for any LightningModule, by flag."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_shard.precision import ShardPrecision
from lightning_shard.strategy import ShardStrategy

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "MFUMonitor",
    "ShardPrecision",
    "ShardStrategy",
    "StragglerDetector",
]

_LAZY = {
    "ActivationCheckpointing": "lightning_shard.activation_checkpointing",
    "MFUMonitor": "lightning_shard.callbacks.mfu",
    "StragglerDetector": "lightning_shard.callbacks.straggler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_shard' has no attribute {name!r}")


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2, 3):
        name = f"zero{stage}"
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name, ShardStrategy, description=f"lightning_shard ZeRO stage {stage} (FSDP2)", stage=stage
            )


_register_strategies()
