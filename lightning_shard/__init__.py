"""lightning_shard: large-model training for any LightningModule, by flag."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_shard._processes import CollectiveTimeoutError
from lightning_shard.checkpoint import CheckpointLoadError
from lightning_shard.checkpoint.init_weights import InitWeightsError
from lightning_shard.config import ShardConfig
from lightning_shard.precision import ShardPrecision
from lightning_shard.strategy import ShardStrategy

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "CheckpointLoadError",
    "CollectiveTimeoutError",
    "EMA",
    "InitWeightsError",
    "MFUMonitor",
    "ShardConfig",
    "ShardPrecision",
    "ShardStrategy",
    "StragglerDetector",
    "ThroughputMonitorFlops",
]

_LAZY = {
    "ActivationCheckpointing": "lightning_shard.activation_checkpointing",
    "EMA": "lightning_shard.averaging",
    "MFUMonitor": "lightning_shard.callbacks",
    "StragglerDetector": "lightning_shard.callbacks",
    "ThroughputMonitorFlops": "lightning_shard.callbacks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_shard' has no attribute {name!r}")


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2, 3):
        _register(StrategyRegistry, f"zero{stage}", f"ZeRO stage {stage} (FSDP2)", stage=stage)
    _register(
        StrategyRegistry,
        "zero2_offload",
        "ZeRO-2, optimizer on CPU (DeepSpeed)",
        stage=2,
        offload_optimizer="cpu",
    )
    _register(
        StrategyRegistry,
        "zero3_offload",
        "ZeRO-3, parameters and optimizer on CPU (FSDP2)",
        stage=3,
        offload_optimizer="cpu",
        offload_params="cpu",
    )

    _register(StrategyRegistry, "zero3_offload_nvme", "ZeRO-3, optimizer and parameters on NVMe (DeepSpeed)")


def _zero3_offload_nvme(**kwargs: Any) -> ShardStrategy:
    """``strategy="zero3_offload_nvme"``: the swap directory comes from ``LIGHTNING_SHARD_NVME_PATH``."""
    import os

    nvme_path = os.environ.get("LIGHTNING_SHARD_NVME_PATH")
    if not nvme_path:
        raise ValueError(
            "strategy='zero3_offload_nvme' needs the NVMe swap directory in the environment variable"
            " LIGHTNING_SHARD_NVME_PATH, or use ShardStrategy(stage=3, offload_optimizer='nvme',"
            " offload_params='nvme', nvme_path=...)."
        )
    return ShardStrategy(
        stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme_path, **kwargs
    )


def _register(registry: Any, name: str, description: str, **init_params: Any) -> None:
    if name not in registry:
        factory = _zero3_offload_nvme if name == "zero3_offload_nvme" else ShardStrategy
        registry.register(name, factory, description=f"lightning_shard {description}", **init_params)


_register_strategies()
