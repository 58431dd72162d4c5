"""Strategy names (``strategy="zero3"``, ...), one line each, for the Trainer's registry and Fabric's.

Both front doors register the same names with the same flags, so ``Trainer(strategy="zero3")`` and
``Fabric(strategy="zero3")`` run the same configuration.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: name -> (description, flags)
NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero1": ("ZeRO stage 1 (FSDP2)", {"stage": 1}),
    "zero2": ("ZeRO stage 2 (FSDP2)", {"stage": 2}),
    "zero3": ("ZeRO stage 3 (FSDP2)", {"stage": 3}),
    "zero2_offload": ("ZeRO-2, optimizer on CPU (DeepSpeed)", {"stage": 2, "offload_optimizer": "cpu"}),
    "zero3_offload": (
        "ZeRO-3, parameters and optimizer on CPU (FSDP2)",
        {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    ),
    "zero3_offload_nvme": ("ZeRO-3, optimizer and parameters on NVMe (DeepSpeed)", {}),
}


class _NvmeFromEnvironment:
    """``strategy="zero3_offload_nvme"``: the swap directory comes from ``LIGHTNING_SHARD_NVME_PATH``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, **kwargs: Any) -> Any:
        nvme_path = os.environ.get("LIGHTNING_SHARD_NVME_PATH")
        if not nvme_path:
            raise ValueError(
                "strategy='zero3_offload_nvme' needs the NVMe swap directory in the environment variable"
                f" LIGHTNING_SHARD_NVME_PATH, or use {self.cls.__name__}(stage=3, offload_optimizer='nvme',"
                " offload_params='nvme', nvme_path=...)."
            )
        return self.cls(
            stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme_path, **kwargs
        )


class LazyClass:
    """A strategy class imported on first use: ``import lightning_shard`` registers the names without
    importing either door (the Trainer's strategy loads ``lightning.pytorch``)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.__name__ = module, name

    def __call__(self, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.__name__)(**kwargs)


def register_names(registry: Any, cls: Any) -> None:
    """Register every name for ``cls`` (a class or a :class:`LazyClass`; a name already taken, by the user or
    Lightning, is left alone)."""
    for name, (description, flags) in NAMES.items():
        if name in registry:
            continue
        factory = _NvmeFromEnvironment(cls) if name == "zero3_offload_nvme" else cls
        registry.register(name, factory, description=f"lightning_shard {description}", **flags)
