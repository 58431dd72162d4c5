"""Peak FLOP/s per device and compute dtype, matched from the device name; a CPU matmul probe.

Every number is the *dense* tensor-core peak in FLOP/s for one device (one GPU, one die pair for
B200/GB200 as NVIDIA sells them). Datasheets print the 2:4-sparsity figure first, which is twice
the dense one; MFU against a sparse peak would read half of the truth, so the table halves those.
Sources: the NVIDIA H100, H200, HGX B200, GB200 NVL72, A100, L40S, L4 and A10 datasheets and the
Ada architecture whitepaper (RTX 4090). ``fp32`` is the non-tensor-core rate; ``tf32`` applies to
fp32 matmuls when TF32 is allowed (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which
``allow_tf32 = True`` and ``torch.set_float32_matmul_precision("high")`` also set).

Where Lightning's own table (``lightning.fabric.utilities.throughput._CUDA_FLOPS``) differs:
it has no fp8 column, no B200 / GB200 / L40S entries (it maps "NVIDIA L40S" to the L4), lists the
H200 and H100 NVL at sparse or two-GPU rates, does not match a plain "NVIDIA H200", and gives the
RTX 4090 its fp32 rate for bf16.
"""

from __future__ import annotations

import re
import time
from typing import Literal

import torch

ComputeDtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8"]

_T = 1e12
# Hopper SXM parts (H100 SXM, H200, GH200) share the same tensor cores and clocks.
_HOPPER_SXM = {
    "fp64": 67 * _T,
    "fp32": 67 * _T,
    "tf32": 494.7 * _T,
    "bf16": 989.4 * _T,
    "fp16": 989.4 * _T,
    "fp8": 1978.9 * _T,
}
# Hopper NVL parts (H100 NVL 94 GB, H200 NVL): the current datasheets are per GPU, not per NVL pair.
_HOPPER_NVL = {
    "fp64": 60 * _T,
    "fp32": 60 * _T,
    "tf32": 417.5 * _T,
    "bf16": 835.5 * _T,
    "fp16": 835.5 * _T,
    "fp8": 1670.5 * _T,
}
# A10 datasheet; AWS publishes none for its A10G variant, so it shares these (as in Lightning).
_A10 = {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}

PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100 sxm": _HOPPER_SXM,
    "h100 pcie": {
        "fp64": 51.2 * _T,
        "fp32": 51.2 * _T,
        "tf32": 378 * _T,
        "bf16": 756 * _T,
        "fp16": 756 * _T,
        "fp8": 1513 * _T,
    },
    "h100 nvl": _HOPPER_NVL,
    "h200": _HOPPER_SXM,
    "h200 nvl": _HOPPER_NVL,
    "gh200": _HOPPER_SXM,
    # Per GPU of an HGX B200 (8 GPUs) and a GB200 NVL72 (72 GPUs), dense.
    "b200": {"fp32": 75 * _T, "tf32": 1125 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T},
    "gb200": {"fp32": 80 * _T, "tf32": 1250 * _T, "bf16": 2500 * _T, "fp16": 2500 * _T, "fp8": 5000 * _T},
    # Ampere has no fp8 tensor cores: an fp8 run on an A100 has no peak to compare with.
    "a100": {"fp64": 19.5 * _T, "fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
    "a10g": _A10,
    "a10": _A10,
    "l40s": {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "fp8": 733 * _T},
    "l40": {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "fp8": 362 * _T},
    "l4": {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T},
    # GeForce: fp16/bf16 with fp32 accumulation (what torch uses) runs at half the fp16-accumulate rate.
    "rtx 4090": {
        "fp32": 82.6 * _T,
        "tf32": 82.6 * _T,
        "bf16": 165.2 * _T,
        "fp16": 165.2 * _T,
        "fp8": 330.3 * _T,
    },
}

# First match wins, so the more specific pattern of a family comes first ("gh200" contains "h200",
# "l40s" starts with "l4"). Names are normalised to lower case with "-"/"_" as spaces.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
    (r"\bgh200\b", "gh200"),
    (r"\bh200\b.*\bnvl\b", "h200 nvl"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bnvl\b", "h100 nvl"),
    (r"\bh100\b.*\b(pcie|hbm2e)\b", "h100 pcie"),
    (r"\bh100\b", "h100 sxm"),  # "H100 80GB HBM3", "H100 SXM5", plain "H100"
    (r"\ba100\b", "a100"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\brtx 4090\b(?! d\b)", "rtx 4090"),  # the 4090 D has fewer SMs
)


def match_device(name: str) -> str | None:
    """The ``PEAK_FLOPS`` key for a device name such as ``torch.cuda.get_device_name()``, or None."""
    normalised = " ".join(re.sub(r"[-_]", " ", name.lower()).split())
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, normalised):
            return key
    return None


def table_peak(device_name: str, dtype: ComputeDtype) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype``; None if the device or the dtype is not in the table."""
    key = match_device(device_name)
    return None if key is None else PEAK_FLOPS[key].get(dtype)


def compute_dtype(precision: str, model: torch.nn.Module, device: torch.device) -> ComputeDtype:
    """The dtype the run's matmuls execute in, which selects the peak to compare with.

    ``precision`` is the Trainer's precision string (``trainer.precision``). fp8 is recognised from
    TransformerEngine precision ("transformer-engine", "transformer-engine-float16") or from
    torchao float8 modules in the model, because float8 training is a model transform, not a
    precision string. fp32 matmuls on CUDA run as TF32 when torch allows it.
    """
    p = str(precision).lower()
    if any(tag in p for tag in ("fp8", "float8", "transformer-engine")) or _has_float8_modules(model):
        return "fp8"
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("64"):
        return "fp64"
    if device.type == "cuda" and _cuda_matmul_allows_tf32():
        return "tf32"
    return "fp32"


def _cuda_matmul_allows_tf32() -> bool:
    """Whether fp32 matmuls on CUDA may run as TF32, whichever of torch's switches turned it on.

    ``fp32_precision`` (torch >= 2.9) reflects all of them: ``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.set_float32_matmul_precision("high")`` and the new per-backend and global
    ``fp32_precision`` settings. The legacy ``allow_tf32`` flag cannot be read once the new API was
    used (torch raises "mix of the legacy and new APIs"), so it is only the fallback for older torch.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # torch < 2.9
        return bool(matmul.allow_tf32)
    return precision == "tf32"


def _has_float8_modules(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("Float8") for m in model.modules())


_PROBE_TORCH_DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def probe_cpu_peak(dtype: ComputeDtype, size: int = 512, budget_s: float = 0.25) -> float:
    """Achievable FLOP/s of this process's CPU threads, from square matmuls in ``dtype``.

    CPUs have no datasheet tensor peak that torch reaches, so MFU on CPU is measured against what a
    large matmul achieves here, now (the best of several timed bursts within ``budget_s``). fp8 has
    no CPU matmul; it is probed as bf16. The global random state is not touched.
    """
    torch_dtype = _PROBE_TORCH_DTYPES.get(dtype, torch.bfloat16)
    # A generator of its own: drawing from the default one would shift every later random number of the run
    # (dropout masks, shuffles), so a run with a monitor would train differently from one without.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(torch_dtype)
    b = torch.randn(size, size, generator=generator).to(torch_dtype)
    torch.mm(a, b)  # first call pays for thread-pool start and packing buffers
    flops_per_mm, best, deadline = 2 * size**3, 0.0, time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * flops_per_mm / max(time.perf_counter() - start, 1e-9))
        if time.perf_counter() > deadline:
            return best
