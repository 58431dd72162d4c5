"""Precision for sharded training: one Lightning Precision plugin for every stage and engine.

Trainer precision strings map to it automatically (``ShardStrategy`` converts Lightning's own
plugin on assignment). The policy it encodes:

================  ===================  =================  ======================  ==============
precision         master weights       compute            gradient reduction      loss scaling
================  ===================  =================  ======================  ==============
``32-true``       fp32                 fp32               fp32                    no
``bf16-mixed``    fp32                 bf16 (autocast)    ``reduce_dtype`` (fp32)  no
``16-mixed``      fp32                 fp16 (autocast)    ``reduce_dtype`` (fp32)  dynamic, global
``bf16-true``     bf16 (no master)     bf16               bf16                    no
================  ===================  =================  ======================  ==============

In mixed modes optimizer state stays fp32. At stages 2-3 FSDP2 additionally all-gathers the
parameters in the low-precision dtype (``MixedPrecisionPolicy.param_dtype``), halving that traffic.
``16-mixed`` uses ``ShardedGradScaler``: its inf/NaN check is all-reduced, so an overflow on any
rank skips the step on every rank, which a per-rank scaler gets wrong once gradients are sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from lightning.pytorch.plugins.precision.half import HalfPrecision
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

PrecisionStr = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = get_args(PrecisionStr)
_LOW_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


def _check_precision(precision: str, where: str) -> None:
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"{where} got precision={precision!r}, which sharded training does not support."
            f" Use one of {', '.join(repr(p) for p in SUPPORTED_PRECISION)}."
        )


class ShardPrecision(Precision):
    """Mixed or low precision for :class:`~lightning_shard.ShardStrategy`, with FP32 master weights.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.
        reduce_dtype: dtype gradients are reduced in across ranks (FSDP2 ``MixedPrecisionPolicy.reduce_dtype``
            at stages 2-3; a DDP compression hook at stages 0-1; DeepSpeed's ``communication_data_type``).
            Default: fp32 in mixed modes.
    """

    def __init__(self, precision: PrecisionStr = "32-true", reduce_dtype: torch.dtype | None = None) -> None:
        _check_precision(precision, "ShardPrecision")
        if reduce_dtype is not None and not (
            isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"ShardPrecision(reduce_dtype={reduce_dtype!r}) must be a floating torch.dtype such as torch.float32."
            )
        self.precision = precision
        self.reduce_dtype = reduce_dtype
        # bf16-true delegates to Lightning's own plugin: built once, not per forward and per batch.
        self._half = HalfPrecision("bf16-true") if precision == "bf16-true" else None
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None
        # Set by the strategy when parameters live on more than one mesh (tensor parallelism, HSDP).
        self.clip_grad_norm: Callable[[list[Tensor], float], Tensor] | None = None

    @classmethod
    def from_plugin(cls, plugin: ShardPrecision) -> ShardPrecision:
        """``plugin`` as this class (an engine's own precision rules), with the same settings."""
        if type(plugin) is cls:
            return plugin
        return cls(plugin.precision, reduce_dtype=plugin.reduce_dtype)  # type: ignore[arg-type]

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are computed in (None: as stored)."""
        return _LOW_DTYPE.get(self.precision)

    @property
    def is_mixed(self) -> bool:
        return self.precision in ("bf16-mixed", "16-mixed")

    def setup_device(self, device: torch.device, process_group: Any = None) -> None:
        """Bind to the run's device; creates the globally-agreeing loss scaler for ``16-mixed``."""
        self.device_type = device.type
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = _Scaler(device=device.type, process_group=process_group)

    def fsdp_mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` for this precision."""
        if self.is_mixed:
            return MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype or torch.float32
            )
        return MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    @override
    def tensor_init_context(self) -> Any:
        if self._half is not None:
            return self._half.tensor_init_context()
        return nullcontext()

    @override
    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self._half is not None:
            return self._half.convert_input(data)
        return data

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            dtype = _LOW_DTYPE[self.precision]
            with torch.autocast(self.device_type, dtype=dtype, cache_enabled=False):
                yield
        elif self._half is not None:
            with self._half.forward_context():
                yield
        else:
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: L.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: L.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "precision='16-mixed' cannot drive LBFGS (it re-evaluates the loss unscaled). Use bf16-mixed."
            )
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            # Unscale before clipping so the norm is of true gradients; the scaler remembers it did.
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_grad_norm is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.clip_grad_norm(list(self.main_params(optimizer)), float(clip_val))
        return None

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class _Scaler(ShardedGradScaler):
    """torch's sharded loss scaler (its inf check all-reduced over every rank, so every pipeline stage and
    data-parallel rank skips the same steps) that first points a ZeRO-1 optimizer's stand-ins for DTensor
    parameters at their gradients (``engines/_zero.py``): what it unscales and checks are the parameters'."""

    def unscale_(self, optimizer: Optimizer) -> None:
        attach = getattr(optimizer, "attach_grads", None)
        if attach is not None:
            attach()
        super().unscale_(optimizer)


def to_shard_precision(plugin: Precision) -> ShardPrecision:
    """Translate the plugin Lightning built from ``Trainer(precision=...)`` into a ShardPrecision."""
    if isinstance(plugin, ShardPrecision):
        return plugin
    if type(plugin) is Precision:
        return ShardPrecision("32-true")
    precision = getattr(plugin, "precision", None)
    if isinstance(precision, str):
        _check_precision(precision, "Trainer(strategy=ShardStrategy(...))")
    if isinstance(plugin, (MixedPrecision, HalfPrecision)):
        return ShardPrecision(plugin.precision)  # type: ignore[arg-type]
    raise ValueError(
        f"ShardStrategy cannot run with the precision plugin {type(plugin).__name__}"
        f" (precision={getattr(plugin, 'precision', '?')!r}). Use Trainer(precision=...) with one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISION)}, or pass lightning_shard.ShardPrecision(...) in plugins."
    )
