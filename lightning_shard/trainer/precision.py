"""The Trainer's precision plugin over the torch-level :class:`~lightning_shard.precision.PrecisionPolicy`.

Lightning builds its own plugin from ``Trainer(precision=...)`` and calls it with the Trainer's signatures
(``pre_backward(tensor, module)``, ``optimizer_step(optimizer, model, closure)``, ``clip_gradients``); the
engines read the policy it holds. Fabric's twin is ``lightning_shard.fabric._precision``: both answer from the
same policy, so autocast, the FSDP2 policy and the loss scaler are one set of rules.
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
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_shard.precision import SUPPORTED_PRECISION, PrecisionPolicy, PrecisionStr, check_precision


class ShardPrecision(Precision):
    """Mixed or low precision for :class:`~lightning_shard.ShardStrategy`, with FP32 master weights.

    Args: those of :class:`~lightning_shard.precision.PrecisionPolicy` (``precision``, ``reduce_dtype``), which
    this plugin holds as ``policy`` and the engines read.
    """

    def __init__(self, precision: PrecisionStr = "32-true", reduce_dtype: torch.dtype | None = None) -> None:
        self.policy = PrecisionPolicy(precision, reduce_dtype)
        self.precision = precision

    @classmethod
    def over(cls, policy: PrecisionPolicy) -> ShardPrecision:
        """The plugin answering from ``policy`` (an engine's own)."""
        plugin = cls.__new__(cls)
        plugin.policy, plugin.precision = policy, policy.precision
        return plugin

    @classmethod
    def for_engine(cls, plugin: Precision, engine: Any, stage: int | str) -> ShardPrecision:
        """The plugin a ShardStrategy runs for the one Lightning built from ``Trainer(precision=...)``, checked
        against the engine at Trainer construction, so an unsupported precision fails before any process
        starts. The user's own ShardPrecision is kept where the engine runs its policy as it is (FSDP)."""
        policy = engine.precision_class.from_plugin(to_policy(plugin))
        engine.check_precision(stage, policy)
        return plugin if isinstance(plugin, cls) and plugin.policy is policy else cls.over(policy)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.policy.reduce_dtype

    @property
    def scaler(self) -> Any:
        """The loss scaler (``16-mixed``, once set up), else ``None``."""
        return self.policy.scaler

    @property
    def is_mixed(self) -> bool:
        return self.policy.is_mixed

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.policy.param_dtype

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.policy.convert_module(module)

    @override
    def tensor_init_context(self) -> Any:
        return self.policy.tensor_init_context()

    @override
    def module_init_context(self) -> Any:
        return self.policy.module_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.policy.convert_input(data)

    @override
    def forward_context(self) -> Any:
        return self.policy.forward_context()

    @override
    def pre_backward(self, tensor: Tensor, module: L.LightningModule) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.policy.scale_loss(tensor), module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: L.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self.policy.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "precision='16-mixed' cannot drive LBFGS (it re-evaluates the loss unscaled). Use bf16-mixed."
            )
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            # Unscale before clipping so the norm is of true gradients; the scaler remembers it did.
            scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output

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

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)


def to_policy(plugin: Precision) -> PrecisionPolicy:
    """The policy of the plugin Lightning built from ``Trainer(precision=...)`` (or the user's ShardPrecision)."""
    if isinstance(plugin, ShardPrecision):
        return plugin.policy
    if type(plugin) is Precision:
        return PrecisionPolicy("32-true")
    precision = getattr(plugin, "precision", None)
    if isinstance(precision, str):
        check_precision(precision, "Trainer(strategy=ShardStrategy(...))")
    if isinstance(plugin, (MixedPrecision, HalfPrecision)):
        return PrecisionPolicy(plugin.precision)  # type: ignore[arg-type]
    raise ValueError(
        f"ShardStrategy cannot run with the precision plugin {type(plugin).__name__}"
        f" (precision={getattr(plugin, 'precision', '?')!r}). Use Trainer(precision=...) with one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISION)}, or pass lightning_shard.ShardPrecision(...) in plugins."
    )
