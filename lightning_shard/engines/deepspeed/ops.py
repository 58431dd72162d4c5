"""DeepSpeed's compiled ops that the DeepSpeed engine and the offload flags load, built ahead of the run.

DeepSpeed compiles its C++ ops the first time a process loads them (a just-in-time build into torch's
extension cache, ``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR``): on a 2-core machine about a
minute for CPU Adam and several minutes for async I/O. Inside a job that build runs on the first step of
rank 0 while the other ranks wait in a collective, and can outlast its timeout. ``lightning-shard
build-ops`` builds them once, before any job, into the same cache. (DeepSpeed's own ahead-of-install build,
``DS_BUILD_AIO=1 pip install deepspeed``, leaves the CPU async-I/O op unlinked from libaio in 0.19.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from lightning_shard._compat import build_directory

log = logging.getLogger(__name__)
#: A JIT-build lock older than this belongs to a build that died.
STALE_LOCK_SECONDS = 30 * 60

#: (DeepSpeed builder class, what loads it, the accelerators it is loaded on: None for every one). The
#: accelerator's own builder class is used for each.
OPS = (
    ("CPUAdamBuilder", "offload_optimizer='cpu' | 'nvme' (DeepSpeedCPUAdam)", None),
    ("AsyncIOBuilder", "NVMe offload (offload_optimizer / offload_params='nvme')", None),
    ("ShareMemCommBuilder", "DeepSpeed's collectives between CPU ranks", ("cpu",)),
    ("FusedAdamBuilder", "DeepSpeed's fused Adam on GPUs", ("cuda",)),
)


class OpBuild(NamedTuple):
    name: str
    used_for: str
    status: str  # "built" (or loaded from the cache), "skipped", "failed"
    detail: str
    seconds: float


def build_deepspeed_ops() -> list[OpBuild]:
    """Load (building where needed) each op of :data:`OPS` this machine's accelerator can run (after removing the
    build locks a killed build left, which would keep every build waiting)."""
    clear_stale_build_locks()
    try:
        from deepspeed.accelerator import get_accelerator  # optional: DeepSpeed
    except ImportError as err:
        raise RuntimeError(
            "lightning-shard build-ops needs DeepSpeed: pip install --no-build-isolation 'lightning-shard[deepspeed]'"
        ) from err
    accelerator = get_accelerator()
    results = []
    kind = str(getattr(accelerator, "_name", "?"))
    for name, used_for, kinds in OPS:
        builder = _builder(accelerator, name) if kinds is None or kind in kinds else None
        if builder is None:
            results.append(OpBuild(name, used_for, "skipped", f"not used on the {kind} accelerator", 0))
            continue
        if not builder.is_compatible(verbose=False):
            why = (
                "libaio not found: apt-get install libaio-dev"
                if name == "AsyncIOBuilder"
                else "not compatible here"
            )
            results.append(OpBuild(builder.name, used_for, "skipped", why, 0))
            continue
        start = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as err:  # a compiler error: reported per op, the others still build
            detail = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            results.append(OpBuild(builder.name, used_for, "failed", detail, time.perf_counter() - start))
            continue
        results.append(OpBuild(builder.name, used_for, "built", "", time.perf_counter() - start))
    return results


def _builder(accelerator: Any, name: str) -> Any:
    try:
        builder_class = accelerator.get_op_builder(name)
    except (AttributeError, ImportError, ValueError):
        return None
    return builder_class() if builder_class is not None else None


def cpu_adam(optimizer: Optimizer, offload: str | None) -> Optimizer:
    """With optimizer offload, a torch ``Adam`` / ``AdamW`` as DeepSpeed's ``DeepSpeedCPUAdam`` with the same param
    groups and hyperparameters (a torch optimizer stepping on host memory is the slow path DeepSpeed warns of)."""
    if offload is None or type(optimizer) not in (
        torch.optim.Adam,
        torch.optim.AdamW,
    ):
        return optimizer
    clear_stale_build_locks()
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional: DeepSpeed

    defaults = optimizer.defaults
    if defaults.get("amsgrad"):
        raise ValueError("DeepSpeedCPUAdam has no amsgrad. Use amsgrad=False with offload_optimizer.")
    groups = [dict(group) for group in optimizer.param_groups]
    return DeepSpeedCPUAdam(
        groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=isinstance(optimizer, torch.optim.AdamW),
    )


def clear_stale_build_locks(max_age_s: float = STALE_LOCK_SECONDS) -> list[Path]:
    """Remove JIT-build ``lock`` files left by a killed build; otherwise every later build waits forever.

    torch's build lock records no owner, so age is the test: a build of DeepSpeed's ops takes minutes,
    a lock older than ``max_age_s`` belongs to a build that died.
    """
    try:
        root = build_directory()
    except Exception:  # noqa: BLE001  (no build directory yet: nothing to clear)
        return []
    removed = []
    for lock in root.rglob("lock"):
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("Removing stale extension build lock %s (a killed build left it).", lock)
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed
