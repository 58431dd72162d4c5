"""Fabric's precision plugin over the torch-level :class:`~lightning_shard.precision.PrecisionPolicy`.

Fabric builds its own plugin from ``Fabric(precision=...)`` and calls it with Fabric's signatures
(``backward(tensor, module)``, ``optimizer_step(optimizer)``); the engines read a ``PrecisionPolicy``
(the FSDP2 ``MixedPrecisionPolicy``, DeepSpeed's ``bf16`` / ``fp16`` sections, ``reduce_dtype``). This
adapter is the one plugin Fabric sees: it holds the same policy the engine was built with, so autocast, the
FSDP2 policy and the loss scaler are the Trainer door's rules too (its plugin holds a policy the same way).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.precision import SUPPORTED_PRECISION, PrecisionPolicy


def to_policy(plugin: Precision) -> PrecisionPolicy:
    """The policy of the plugin Fabric built from ``Fabric(precision=...)`` (or the user's ShardPrecision,
    the Trainer door's plugin, which holds one: this door does not import it)."""
    policy = getattr(plugin, "policy", None)
    if isinstance(policy, PrecisionPolicy):
        return policy
    if isinstance(plugin, FabricShardPrecision):
        return plugin.shard
    if type(plugin) is Precision:
        return PrecisionPolicy("32-true")
    precision = getattr(plugin, "precision", None)
    if isinstance(plugin, (MixedPrecision, HalfPrecision)) and precision in SUPPORTED_PRECISION:
        return PrecisionPolicy(precision)
    raise ValueError(
        f"ShardFabricStrategy cannot run with the precision plugin {type(plugin).__name__}"
        f" (precision={precision!r}). Use Fabric(precision=...) with one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISION)}, or pass lightning_shard.ShardPrecision(...) in plugins."
    )


def _to_float32(tensor: Tensor) -> Tensor:
    return tensor.float() if torch.is_floating_point(tensor) else tensor


class FabricShardPrecision(Precision):
    """What Fabric calls, answered by the precision policy the engine runs with."""

    def __init__(self, shard: PrecisionPolicy) -> None:
        self.shard = shard
        self.precision = shard.precision  # type: ignore[assignment]

    @override
    def convert_module(self, module: Module) -> Module:
        return self.shard.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.shard.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.shard.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.shard.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.shard.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        # As Fabric's own mixed plugin: outputs leave the model in float32 (the loss is computed outside).
        if self.shard.is_mixed:
            return apply_to_collection(data, Tensor, _to_float32)
        return data

    @override
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Any:
        return self.shard.scale_loss(tensor)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        scaler = self.shard.scaler
        if scaler is None:
            return optimizer.step(**kwargs)
        # The scaler's inf check is all-reduced: an overflow on any rank skips the step on every rank.
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        scaler = self.shard.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.shard.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shard.load_state_dict(state_dict)
