"""Counting the FLOPs of one real training step, split into forward, backward and recompute.

``StepFlopCounter`` is ``torch.utils.flop_counter.FlopCounterMode`` (the same per-op formulas) with
three additions: each count is tagged with the autograd phase it ran in, the CPU flash-attention
kernel that torch's registry lacks is counted, and ops on tensor subclasses (DTensor) are counted
at the size each rank computes. ``FirstStepFlops`` runs one over the first training step while it
runs and scales the count to later batches (shared by ``MFUMonitor`` and ``ThroughputMonitorFlops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from typing_extensions import override

from lightning_shard._batch import batch_shape

try:  # private: lets ops on tensor subclasses be counted locally; without it DTensor ops count globally
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
    from torch.utils.flop_counter import _FlopCounterMode
except ImportError:  # pragma: no cover - depends on the torch version
    _FlopCounterMode = None  # type: ignore[assignment,misc]

Phase = Literal["forward", "backward", "recompute"]


# Private: which autograd graph task runs now (-1: none, i.e. forward). Without it (a future torch),
# every count is filed under forward: totals stay right, the backward / recompute split is lost.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _autograd_phase() -> Phase:
    if _graph_task_id() == -1:
        return "forward"
    return "recompute" if torch.is_grad_enabled() else "backward"


if _FlopCounterMode is not None:

    class _LocalFlopDispatch(_FlopCounterMode):
        @override
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # Returning NotImplemented hands the op to a wrapper subclass (DTensor, float8 tensors), whose
            # ops on its inner tensors then come back through this mode and are counted at their local
            # size. Other subclasses (FakeTensor in DTensor's sharding propagation) are left alone.
            if any(is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)


def _cpu_attention_formulas() -> dict[Any, Callable[..., int]]:
    # torch's registry has the CUDA fused-attention kernels but not the CPU flash kernel, whose
    # leading arguments (q, k, v) / (grad_out, q, k, v) are the same: without these entries CPU
    # attention counts 0 FLOPs.
    aten = torch.ops.aten
    pairs = [
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention_backward",
        ),
    ]
    return {
        getattr(aten, cpu): _raw(flop_registry[getattr(aten, cuda)])
        for cpu, cuda in pairs
        if hasattr(aten, cpu) and getattr(aten, cuda) in flop_registry
    }


def _raw(formula: Callable[..., int]) -> Callable[..., int]:
    def raw(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    # Registry formulas already take the raw (args, out_val): tell FlopCounterMode not to wrap again.
    raw._get_raw = True  # type: ignore[attr-defined]
    return raw


# Usable as ``FlopCounterMode(custom_mapping=CPU_ATTENTION_FLOPS)`` too.
CPU_ATTENTION_FLOPS = _cpu_attention_formulas()


def _grouped_mm_flops(mat_a: Any, mat_b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """``aten._grouped_mm`` (expert parallelism's local experts), which torch's registry lacks: each row of one
    operand meets one group's matrix, so the FLOPs are ``2 x rows x contracted x columns`` over the groups."""
    a, b = tuple(mat_a.shape), tuple(mat_b.shape)
    if len(a) == 2 and len(b) == 3:  # rows grouped, one [K, N] per group: [R, K] x [G, K, N]
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # the contraction grouped (a weight's gradient): [M, K] x [K, N]
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:  # batched: [G, M, K] x [G, K, N]
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[1] * a[2] * b[1]  # columns grouped: [G, M, K] x [K, N]


_grouped_mm_flops._get_raw = True  # type: ignore[attr-defined]
#: Expert parallelism's grouped GEMM; without it the experts' FLOPs count 0 where it runs.
GROUPED_MM_FLOPS: dict[Any, Callable[..., int]] = (
    {torch.ops.aten._grouped_mm: _grouped_mm_flops} if hasattr(torch.ops.aten, "_grouped_mm") else {}
)


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every count goes to ``"Global"`` alone."""

    parents = ("Global",)

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


class StepFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` whose total is also split by autograd phase (``by_phase``).

    ``recompute`` holds the forward work redone in backward: checkpointed regions, and the score
    matrix QK^T that fused (flash / memory-efficient / cuDNN / flex) attention recomputes in its
    backward instead of storing. torch counts that backward as five equal matmuls (QK^T, then
    dO V^T, P^T dO, dS K, dS^T Q), so one fifth is the recompute. Model FLOPs therefore equal the
    textbook 6N + 12·L·T·d per token whichever attention kernel ran.

    May be entered in one hook and left in another; nothing else must push a dispatch mode in between
    without popping it.
    """

    def __init__(self) -> None:
        self.by_phase: dict[Phase, int] = {"forward": 0, "backward": 0, "recompute": 0}
        registry = {**flop_registry, **CPU_ATTENTION_FLOPS, **GROUPED_MM_FLOPS}
        super().__init__(
            display=False, custom_mapping={op: self._tagged(op, f) for op, f in registry.items()}
        )
        # Only the global total is used: no per-module breakdown, whose tracker hooks every module's
        # outputs for backward and breaks torch.autograd.grad on leaf inputs (pipeline stages run it).
        self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]

    def _tagged(self, op: Any, formula: Callable[..., int]) -> Callable[..., int]:
        fused_attention_backward = "attention" in str(op) and str(op).endswith("backward")

        def counted(*args: Any, **kwargs: Any) -> int:
            if "out_shape" in kwargs:  # shape-wrapped by a torch that ignores _get_raw; shapes pass through
                kwargs["out_val"] = kwargs.pop("out_shape")
            flops = formula(*args, **kwargs)
            phase = _autograd_phase()
            if fused_attention_backward and phase == "backward":
                self.by_phase["recompute"] += flops // 5
                flops_left = flops - flops // 5
            else:
                flops_left = flops
            self.by_phase[phase] += flops_left
            return flops

        # Registry formulas already take the raw (args, out_val): tell FlopCounterMode not to wrap again.
        counted._get_raw = True  # type: ignore[attr-defined]
        return counted

    @override
    def __enter__(self) -> StepFlopCounter:
        self.by_phase = dict.fromkeys(self.by_phase, 0)  # type: ignore[assignment]
        super().__enter__()
        if _FlopCounterMode is not None and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = _LocalFlopDispatch(self)
            self.mode.__enter__()
        return self

    @property
    def model_flops(self) -> int:
        return self.by_phase["forward"] + self.by_phase["backward"]

    @property
    def hardware_flops(self) -> int:
        return self.model_flops + self.by_phase["recompute"]


def _force_eager() -> Any:
    """``torch.compiler.set_stance("force_eager")``, entered; None on a torch without it."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return None if set_stance is None else set_stance("force_eager")


class FirstStepFlops:
    """The FLOPs of the first training step, counted while it runs and scaled to later batches.

    ``start(batch)`` at the first batch's start enters a :class:`StepFlopCounter`; ``stop()`` before
    its optimizer step (or at its end) leaves it. The step's own forward and backward are what is
    counted: nothing is run a second time. Later batches are scaled by their token count (samples x
    sequence length of the first tensor) against the counted one.
    """

    def __init__(self) -> None:
        self.counted: dict[str, float] | None = None
        self._counter: StepFlopCounter | None = None
        self._units = 0.0
        self._stance: Any = None

    def reset(self) -> None:
        self.abort()
        self.counted = None

    def start(self, batch: Any) -> None:
        if self.counted is not None or self._counter is not None:
            return
        samples, tokens = batch_shape(batch)
        self._units = float(tokens or samples)
        # Compiled code runs eagerly while counted: dynamo does not compile under a dispatch mode, and a
        # function it met under one is never compiled afterwards (MFUMonitor would turn compile off).
        self._stance = _force_eager()
        self._counter = StepFlopCounter().__enter__()

    def stop(self) -> bool:
        """Leave the counter; True when this call finished the count."""
        counter, self._counter = self._counter, None
        if counter is None:
            return False
        counter.__exit__(None, None, None)
        self._restore_stance()
        self.counted = {
            "model_flops": counter.model_flops,
            "hardware_flops": counter.hardware_flops,
            "forward_flops": counter.by_phase["forward"],
            "units": self._units,
        }
        return True

    def abort(self) -> None:
        # A dispatch mode left on the stack would count every later op of the process.
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
            self._restore_stance()

    def _restore_stance(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    def scaled(self, batch: Any, key: str = "model_flops") -> float | None:
        """``counted[key]`` scaled to ``batch``'s token count; None before the count or for an empty one."""
        if self.counted is None or not self.counted["units"]:
            return None
        samples, tokens = batch_shape(batch)
        return self.counted[key] * (tokens or samples) / self.counted["units"]
