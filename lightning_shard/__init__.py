"""lightning_shard: large-model training for any LightningModule, by flag."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "MFUMonitor",
    "ShardPrecision",
    "ShardStrategy",
    "StragglerDetector",
]

_LAZY = {
    "ShardStrategy": "lightning_shard.strategy",
    "ShardPrecision": "lightning_shard.precision",
    "ActivationCheckpointing": "lightning_shard.activation_checkpointing",
    "MFUMonitor": "lightning_shard.callbacks.mfu",
    "StragglerDetector": "lightning_shard.callbacks.straggler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_shard' has no attribute {name!r}")
