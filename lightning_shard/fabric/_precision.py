"""Fabric's precision plugin over the torch-level :class:`~lightning_shard.precision.PrecisionPolicy`.

Fabric builds its own plugin from ``Fabric(precision=...)`` and calls it with Fabric's signatures
(``backward(tensor, module)``, ``optimizer_step(optimizer)``); the engines read a ``PrecisionPolicy``
(the FSDP2 ``MixedPrecisionPolicy``, DeepSpeed's ``bf16`` / ``fp16`` sections, ``reduce_dtype``). This
adapter is the one plugin Fabric sees: it holds the same policy the engine was built with, as ``policy`` like the
Trainer door's plugin, and what only forwards to it is both doors' (:mod:`lightning_shard.core.precision`), so
autocast, the FSDP2 policy and the loss scaler are the Trainer door's rules too.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.core.precision import Door, PolicyPrecision


def _to_float32(tensor: Tensor) -> Tensor:
    return tensor.float() if torch.is_floating_point(tensor) else tensor


class FabricShardPrecision(PolicyPrecision):
    """What Fabric calls, answered by the precision policy the engine runs with."""

    _door = Door(
        name="Fabric", strategy="ShardFabricStrategy", plain=Precision, mixed=(MixedPrecision, HalfPrecision)
    )

    @override
    def convert_output(self, data: Any) -> Any:
        # As Fabric's own mixed plugin: outputs leave the model in float32 (the loss is computed outside).
        if self.policy.is_mixed:
            return apply_to_collection(data, Tensor, _to_float32)
        return data

    @override
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Any:
        return self.policy.scale_loss(tensor)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self.policy.step(optimizer, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.policy.unscale(optimizer)
