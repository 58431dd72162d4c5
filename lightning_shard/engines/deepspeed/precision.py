"""DeepSpeed's precision rules, kept with the DeepSpeed engine (as Lightning keeps its DeepSpeed plugin).

Once DeepSpeed has wrapped the model it holds the low-precision weights, scales the loss and clips
inside its own step: the plugin then only casts floating inputs to the weights' dtype and leaves
autocast, loss scaling and clipping to the engine. Before that (evaluation outside ``fit``, where
the module runs unwrapped with fp32 weights) it behaves like the FSDP engine's :class:`PrecisionPolicy`.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_shard.precision import PrecisionPolicy

COMM_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_precision(stage: int | str, precision: PrecisionPolicy) -> None:
    """Refuse precisions DeepSpeed cannot serve, naming the fix (``stage`` may still be ``"auto"``)."""
    if precision.precision == "bf16-true":
        raise ValueError(
            "ShardStrategy(engine='deepspeed') cannot run precision='bf16-true': DeepSpeed always keeps fp32 master"
            " weights. Use 'bf16-mixed', or engine='fsdp' for bf16-true."
        )
    if precision.precision == "16-mixed" and stage == 0:
        # DeepSpeed's fp16 optimizer without ZeRO divides every gradient by the loss scale in step(),
        # but engine.backward() only scales the loss for ZeRO optimizers: each update comes out
        # 65536x too small and the weights never move (DeepSpeed 0.19; deepspeedai/DeepSpeed#8393).
        raise ValueError(
            "ShardStrategy(stage=0, engine='deepspeed') cannot run precision='16-mixed': without ZeRO,"
            " DeepSpeed unscales fp16 gradients that its backward never scaled, so training stalls."
            " Use stage=1 or higher, precision='bf16-mixed', or engine='fsdp' for stage 0."
        )
    if precision.reduce_dtype is not None and precision.reduce_dtype not in COMM_DTYPES:
        raise ValueError(
            f"ShardPrecision(reduce_dtype={precision.reduce_dtype}) is not available with engine='deepspeed',"
            " which reduces gradients in torch.float32, torch.bfloat16 or torch.float16. Use one of those."
        )


def cpu_supports_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator serves fp16 on this CPU.

    It asks oneDNN, whose fp16 kernels need AVX512-FP16 or AMX-FP16 (recent Intel Xeons; AMD EPYC has
    neither), and treats a torch without the probe as no fp16 (DeepSpeed 0.19,
    ``CPU_Accelerator.is_fp16_supported``).
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_device_precision(device: torch.device, precision: PrecisionPolicy) -> None:
    """Refuse what DeepSpeed cannot run on ``device`` (known only once the strategy sets up)."""
    if precision.precision == "16-mixed" and device.type == "cpu" and not cpu_supports_fp16():
        # DeepSpeed itself fails later, inside deepspeed.initialize ("Type fp16 is not supported on
        # your device"), after the model was built and moved.
        raise ValueError(
            "ShardStrategy(engine='deepspeed') cannot run precision='16-mixed' on this CPU: DeepSpeed's CPU"
            " accelerator has no fp16 support here (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False;"
            " oneDNN's fp16 kernels need AVX512-FP16 or AMX-FP16, which CPUs such as AMD EPYC lack)."
            " Use precision='bf16-mixed', or engine='fsdp' (fp16 autocast runs on any CPU), or a GPU."
        )


class DeepSpeedPrecision(PrecisionPolicy):
    """The precision policy of the DeepSpeed engine, built from the door's precision like the FSDP engine's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_active = False
        self.engine_clip_val: float | None = None  # the clip value DeepSpeed applies inside its step

    def engine_started(self, clip_val: float | None) -> None:
        self.engine_active, self.engine_clip_val = True, clip_val

    @override
    def setup_device(self, device: torch.device, process_group: Any = None) -> None:
        self.device_type = device.type  # no loss scaler: DeepSpeed scales fp16 losses itself

    @override
    def convert_input(self, data: Any) -> Any:
        if not (self.engine_active and self.param_dtype is not None):
            return super().convert_input(data)
        dtype = self.param_dtype
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.engine_active:
            yield  # DeepSpeed holds the weights in the compute dtype: no autocast
            return
        with super().forward_context():
            yield

    @override
    def engine_clips(self, clip_val: float) -> bool:
        if clip_val and clip_val != self.engine_clip_val:
            # Only self.clip_gradients() in manual optimization gets here with its own value: DeepSpeed
            # clips inside its step, at the Trainer's gradient_clip_val, which Lightning does not allow
            # with manual optimization.
            raise ValueError(
                f"self.clip_gradients(gradient_clip_val={clip_val}) is not available with"
                " ShardStrategy(engine='deepspeed'), which clips inside its optimizer step from"
                " Trainer(gradient_clip_val=...) only (not allowed with manual optimization)."
                " Use engine='fsdp' to clip in manual optimization, or automatic optimization."
            )
        return True
