"""The Trainer's precision plugin over the torch-level :class:`~lightning_shard.precision.PrecisionPolicy`.

Lightning builds its own plugin from ``Trainer(precision=...)`` and calls it with the Trainer's signatures
(``pre_backward(tensor, module)``, ``optimizer_step(optimizer, model, closure)``, ``clip_gradients``); the
engines read the policy it holds. What only forwards to the policy, and the translation of Lightning's own
plugins, are both doors' (:mod:`lightning_shard.core.precision`); Fabric's twin is
``lightning_shard.fabric._precision``, so autocast, the FSDP2 policy and the loss scaler are one set of rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from lightning.pytorch.plugins.precision.half import HalfPrecision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_shard.core.precision import Door, PolicyPrecision
from lightning_shard.precision import PrecisionPolicy, PrecisionStr


class ShardPrecision(PolicyPrecision, Precision):
    """Mixed or low precision for :class:`~lightning_shard.ShardStrategy`, with FP32 master weights.

    Args: those of :class:`~lightning_shard.precision.PrecisionPolicy` (``precision``, ``reduce_dtype``), which
    this plugin holds as ``policy`` and the engines read.
    """

    _door = Door(
        name="Trainer",
        strategy="ShardStrategy",
        plain=Precision,
        mixed=(MixedPrecision, HalfPrecision),
        check_where="Trainer(strategy=ShardStrategy(...))",
    )

    def __init__(self, precision: PrecisionStr = "32-true", reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(PrecisionPolicy(precision, reduce_dtype))

    @override
    def pre_backward(self, tensor: Tensor, module: L.LightningModule) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.policy.scale_loss(tensor), module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: L.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.policy.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "precision='16-mixed' cannot drive LBFGS (it re-evaluates the loss unscaled). Use bf16-mixed."
            )
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            self.policy.unscale(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        return self.policy.step(optimizer, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self.policy.engine_clips(float(clip_val or 0.0)):
            return
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.policy.clip_grad_norm is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.policy.clip_grad_norm(list(self.main_params(optimizer)), float(clip_val))
        return None
