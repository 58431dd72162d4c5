"""The local experts' matrix products: one grouped GEMM where torch has a kernel for the device and dtype, a loop
over the experts elsewhere. Both give the same numbers; the choice is made at run time, per call.

Rows arrive grouped expert by expert (``counts[e]`` rows for local expert ``e``), so expert ``e``'s product is
``rows[o_e : o_e + counts[e]] @ W[e]`` with ``o_e = counts[0] + ... + counts[e-1]``: exactly what
``torch.nn.functional.grouped_mm(rows, W, offs=cumsum(counts))`` computes in one kernel.

Where torch 2.13's grouped GEMM runs (checked): CPU, float32 / bfloat16 / float16, when every non-unit stride
and the data pointers are multiples of 16 bytes (else "strides should be multiple of 16 bytes"), forward and
backward, empty groups and zero rows included; its backward refuses a gradient with zero strides (an expanded
``sum()`` gradient), hence the contiguity hook. CUDA: bfloat16 on SM80+ per torch's documentation. Under
``torch.compile`` bfloat16 only (the op's meta function refuses the rest). Anything else (float64, unaligned
widths) takes the loop.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

#: ``"auto"``: the grouped GEMM where it runs, else the loop; ``"grouped_mm"`` / ``"loop"``: that one always.
ComputeMode = Literal["auto", "grouped_mm", "loop"]
COMPUTE_MODES: tuple[str, ...] = ("auto", "grouped_mm", "loop")


def _grouped_kernel() -> object | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build has a grouped GEMM kernel for the device type and dtype (tried once, on an
    aligned toy problem: builds differ, e.g. torch <= 2.8 had no CPU kernel at all)."""
    if _grouped_kernel() is None:
        return False
    device = torch.device(device_type)
    if device.type == "cuda":
        # CUDA path: torch's grouped GEMM (CUTLASS) serves bfloat16 on compute capability >= 8.0 (SM80+); the
        # toy call below is the check for anything else a build may add.
        if torch.cuda.get_device_capability() < (8, 0):
            return False
    try:
        with torch.no_grad():
            rows = torch.zeros(16, 8, device=device, dtype=dtype)
            weight = torch.zeros(2, 8, 8, device=device, dtype=dtype)
            _grouped_mm(rows, weight, torch.tensor([8, 16], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _aligned(t: Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_runs(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``rows [R, K] @ weight [E, K, N]`` (grouped) can go to torch's grouped GEMM kernel here."""
    if rows.dtype != weight.dtype or rows.device != weight.device or rows.device.type not in ("cpu", "cuda"):
        return False
    if torch.compiler.is_compiling():
        # Traced (compile=...): the op's meta function (torch 2.13) takes bfloat16 alone, whatever the device's
        # kernel runs eagerly; other dtypes take the loop, which compiles as plain matmuls.
        return rows.dtype == torch.bfloat16
    return _aligned(rows) and _aligned(weight) and _kernel_runs(rows.device.type, rows.dtype)


def _grouped_mm(rows: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    kernel = getattr(F, "grouped_mm", None)
    if kernel is not None:
        return kernel(rows, weight, offs=offsets)
    return torch._grouped_mm(rows, weight, offs=offsets)


def _contiguous_grad(grad: Tensor) -> Tensor:
    return grad.contiguous()


def grouped_linear(
    rows: Tensor,
    weight: Tensor,
    counts: list[int],
    bias: Tensor | None = None,
    transposed: bool = False,
    mode: ComputeMode = "auto",
) -> Tensor:
    """Expert ``e``'s linear map on its ``counts[e]`` rows, for every local expert: ``[R, K] -> [R, N]``.

    ``weight`` is ``[E, N, K]`` (``nn.Linear``'s ``[out, in]`` per expert), or ``[E, K, N]`` when ``transposed``;
    ``bias`` ``[E, N]``. Every expert's weight takes part in the graph, so an expert with no rows gets a zero
    gradient rather than none.
    """
    w = weight if transposed else weight.transpose(-2, -1)  # [E, K, N]
    rows = rows.contiguous()
    use_kernel = mode == "grouped_mm" or (mode == "auto" and grouped_mm_runs(rows, w))
    if use_kernel:
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(rows.device)
        out = _grouped_mm(rows, w, offsets)  # [R, N]
        if out.requires_grad:
            out.register_hook(_contiguous_grad)
    else:
        # One product per expert, empty ones included (they keep every expert in the graph).
        out = torch.cat([part @ w[e] for e, part in enumerate(rows.split(counts))])  # [R, N]
    if bias is not None:
        repeats = torch.tensor(counts, device=bias.device)
        out = out + bias.repeat_interleave(repeats, dim=0, output_size=rows.shape[0])  # [R, N]
    return out
