"""The precision policy of sharded training, on torch alone: dtypes, autocast, the loss scaler, FSDP2's
mixed-precision policy. Each door adapts it to its framework's plugin interface (the Trainer's
:class:`~lightning_shard.ShardPrecision`, Fabric's ``FabricShardPrecision``); the engines read it (FSDP2's
``MixedPrecisionPolicy``, DeepSpeed's ``bf16`` / ``fp16`` sections and ``communication_data_type``).

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

import torch
from lightning.fabric.plugins.precision import HalfPrecision
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

PrecisionStr = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = get_args(PrecisionStr)
_LOW_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


def check_precision(precision: str, where: str) -> None:
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"{where} got precision={precision!r}, which sharded training does not support."
            f" Use one of {', '.join(repr(p) for p in SUPPORTED_PRECISION)}."
        )


class PrecisionPolicy:
    """One precision setting and everything it implies, with FP32 master weights in the mixed modes.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.
        reduce_dtype: dtype gradients are reduced in across ranks (FSDP2 ``MixedPrecisionPolicy.reduce_dtype``
            at stages 2-3; a DDP compression hook at stages 0-1; DeepSpeed's ``communication_data_type``).
            Default: fp32 in mixed modes.
    """

    def __init__(self, precision: PrecisionStr = "32-true", reduce_dtype: torch.dtype | None = None) -> None:
        check_precision(precision, "ShardPrecision")
        if reduce_dtype is not None and not (
            isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"ShardPrecision(reduce_dtype={reduce_dtype!r}) must be a floating torch.dtype such as torch.float32."
            )
        self.precision = precision
        self.reduce_dtype = reduce_dtype
        # bf16-true's contexts are Fabric's own (default dtype, input casts): built once, not per forward.
        self._half = HalfPrecision("bf16-true") if precision == "bf16-true" else None
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None
        #: Set at set-up where parameters live on more than one mesh (tensor parallelism, pipeline stages).
        self.clip_grad_norm: Callable[[list[Tensor], float], Tensor] | None = None

    @classmethod
    def from_plugin(cls, plugin: Any) -> PrecisionPolicy:
        """``plugin``'s settings as this class (an engine's own precision rules): ``plugin`` is a policy or a
        door's adapter over one (anything with ``precision`` and ``reduce_dtype``)."""
        if type(plugin) is cls:
            return plugin
        return cls(plugin.precision, reduce_dtype=plugin.reduce_dtype)

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
            self.scaler = ShardedGradScaler(device=device.type, process_group=process_group)

    def fsdp_mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` for this precision."""
        if self.is_mixed:
            return MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype or torch.float32
            )
        return MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    def tensor_init_context(self) -> Any:
        if self._half is not None:
            return self._half.tensor_init_context()
        return nullcontext()

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self._half is not None:
            return self._half.convert_input(data)
        return data

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

    def scale_loss(self, tensor: Tensor) -> Tensor:
        """The loss the backward starts from: multiplied by the loss scale under ``16-mixed``."""
        return self.scaler.scale(tensor) if self.scaler is not None else tensor

    def unscale(self, optimizer: Optimizer) -> None:
        """Under ``16-mixed``, divide ``optimizer``'s gradients by the loss scale (before clipping, so the norm is
        of true gradients); the scaler remembers it did, and its step does not unscale again."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``, through the loss scaler under ``16-mixed``: its inf check is all-reduced,
        so an overflow on any rank skips the step on every rank; the scale is updated after."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output

    def engine_clips(self, clip_val: float) -> bool:
        """Whether the engine clips inside its own step (DeepSpeed), so a door's clip must not; refuses a
        clip value the engine cannot apply."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
