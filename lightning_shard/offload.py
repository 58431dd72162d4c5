"""Offload flags: validation, engine choice, and the checks an NVMe directory must pass.

Which engine serves which combination (``engine="auto"``):

================================================  ==========  ========================================
flags                                             engine      how
================================================  ==========  ========================================
no offload                                        FSDP2       ``fully_shard`` / DDP
stage 3, ``offload_params="cpu"``,                FSDP2       ``CPUOffloadPolicy``: parameters, gradients
``offload_optimizer="cpu"``                                   and the optimizer step live on the host
``offload_optimizer="cpu"`` alone (any stage)     DeepSpeed   ZeRO-Offload, DeepSpeed CPU-Adam
anything with ``"nvme"``                          DeepSpeed   ZeRO-Infinity, swap files via libaio
================================================  ==========  ========================================
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Literal

OffloadDevice = Literal["cpu", "nvme"]
_DEVICES = (None, "cpu", "nvme")
SWAP_DIRNAME = "lightning_shard_swap"


def validate(
    stage: int, offload_optimizer: str | None, offload_params: str | None, nvme_path: str | None
) -> None:
    """Check the offload flags against each other (which engine serves the pair is the engines' declaration,
    ``Capabilities.offload``)."""
    for flag, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        if value not in _DEVICES:
            raise ValueError(
                f"ShardStrategy({flag}={value!r}) is not an offload target. Use None (keep it on the accelerator),"
                " 'cpu' (host memory) or 'nvme' (swap files under nvme_path)."
            )
    if offload_params is not None and stage < 3:
        raise ValueError(
            f"ShardStrategy(offload_params={offload_params!r}) needs stage=3 (got stage={stage}): parameters are"
            " only sharded at stage 3. Use stage=3 or drop offload_params."
        )
    if offload_optimizer is not None and stage == 0:
        raise ValueError(
            f"ShardStrategy(offload_optimizer={offload_optimizer!r}) needs stage >= 1 (got stage=0): optimizer state"
            " is offloaded only under ZeRO (stages 1-3). Use stage=1 or higher, or drop offload_optimizer."
        )
    uses_nvme = "nvme" in (offload_optimizer, offload_params)
    if uses_nvme and stage < 3:
        raise ValueError(
            f"ShardStrategy(offload_optimizer={offload_optimizer!r}, offload_params={offload_params!r}) with NVMe"
            f" needs stage=3 (got stage={stage}): DeepSpeed ignores NVMe offload below stage 3 and writes no swap"
            " files. Use stage=3, or offload_optimizer='cpu'."
        )
    if uses_nvme and nvme_path is None:
        raise ValueError(
            "ShardStrategy(offload_...='nvme') needs nvme_path: the directory on the NVMe drive to swap to."
        )
    if nvme_path is not None and not uses_nvme:
        raise ValueError(
            f"ShardStrategy(nvme_path={nvme_path!r}) is set but nothing is offloaded to 'nvme'."
            " Set offload_optimizer='nvme' / offload_params='nvme', or drop nvme_path."
        )
    if uses_nvme:
        assert nvme_path is not None
        check_nvme_path(nvme_path)
        require_libaio()


#: The refusal when a flag needs DeepSpeed and it is not installed (the DeepSpeed engine's ``requires``).
DEEPSPEED_MISSING = (
    "ShardStrategy needs DeepSpeed for these flags (engine='deepspeed', NVMe offload, or optimizer-only CPU"
    " offload), and it is not installed. Run: pip install setuptools && pip install --no-build-isolation 'lightning-shard[deepspeed]'"
    " (after torch)."
)


def require_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError(DEEPSPEED_MISSING)


def check_nvme_path(nvme_path: str, need_bytes: int = 0) -> Path:
    """The NVMe directory must exist, be a writable directory, and have room for the swapped state."""
    path = Path(nvme_path)
    if not path.exists():
        raise ValueError(
            f"ShardStrategy(nvme_path={nvme_path!r}) does not exist. Create the directory first."
        )
    if not path.is_dir():
        raise ValueError(f"ShardStrategy(nvme_path={nvme_path!r}) is not a directory.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"ShardStrategy(nvme_path={nvme_path!r}) is not writable by this user.")
    free = shutil.disk_usage(path).free
    if need_bytes and free < need_bytes:
        raise ValueError(
            f"ShardStrategy(nvme_path={nvme_path!r}) has {free / 2**30:.2f} GiB free but the offloaded state needs"
            f" {need_bytes / 2**30:.2f} GiB. Free space or choose another drive."
        )
    return path


def require_libaio() -> None:
    """DeepSpeed's NVMe swapping goes through libaio; fail early, with the package to install."""
    require_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder  # optional: DeepSpeed

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ValueError(
            "NVMe offload needs libaio, which DeepSpeed cannot find. Install it: apt-get install libaio-dev"
            " (Debian/Ubuntu) or yum install libaio-devel, then retry."
        )


def swap_dir(nvme_path: str, rank: int) -> Path:
    """This run's own swap directory under nvme_path; nothing outside nvme_path is ever written."""
    return Path(nvme_path) / SWAP_DIRNAME / f"rank{rank}"


def clear_swap(nvme_path: str, rank: int, remove_parent: bool = True) -> None:
    """Remove this rank's swap files (at teardown, and at start after a crashed run).

    At start, ``remove_parent=False``: another rank may be creating its directory under the shared
    parent at that moment, and removing the (still empty) parent would pull it from under that rank.
    """
    shutil.rmtree(swap_dir(nvme_path, rank), ignore_errors=True)
    if not remove_parent:
        return
    parent = Path(nvme_path) / SWAP_DIRNAME
    try:
        parent.rmdir()  # only once every rank's directory is gone
    except OSError:
        pass
