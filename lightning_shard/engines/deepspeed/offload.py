"""ZeRO-Infinity's NVMe offload under the DeepSpeed engine: this rank's swap folder made ready before
``deepspeed.initialize`` (a crashed run's leftovers removed, the free space checked against what will be
swapped), the bytes it holds, and its removal at teardown.

The folder layout and the checks are :mod:`lightning_shard.offload`'s (the planner reads them too); CPU offload
needs nothing here (DeepSpeed's config, :mod:`.config`, and CPU-Adam, :mod:`.ops`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard import offload
from lightning_shard.engines.base import RunContext


def swaps(config: Any) -> bool:
    """Something is offloaded to NVMe (``offload_optimizer`` or ``offload_params`` is ``"nvme"``)."""
    return "nvme" in (config.offload_optimizer, config.offload_params)


def swap_bytes(config: Any, module: nn.Module, world_size: int) -> int:
    """This rank's bytes on NVMe: fp32 master + two Adam moments (12 B/param), fp32 parameters (4 B)."""
    numel = sum(p.numel() for p in module.parameters()) / max(world_size, 1)
    per_param = (12 if config.offload_optimizer == "nvme" else 0) + (
        4 if config.offload_params == "nvme" else 0
    )
    return int(numel * per_param)


def prepare_swap(config: Any, module: nn.Module, run: RunContext) -> None:
    """This rank's swap folder, empty and with room for what it will hold (nothing to do without NVMe)."""
    if not swaps(config):
        return
    assert config.nvme_path is not None
    offload.clear_swap(config.nvme_path, run.global_rank, remove_parent=False)  # a crashed run's leftovers
    offload.check_nvme_path(config.nvme_path, swap_bytes(config, module, run.world_size))
    offload.swap_dir(config.nvme_path, run.global_rank).mkdir(parents=True, exist_ok=True)


def swapped(config: Any, run: RunContext) -> tuple[str, int] | None:
    """``(kind, bytes)`` this rank's swap folder holds now, the kind being what is offloaded to NVMe."""
    if config.nvme_path is None:
        return None
    files = offload.swap_dir(config.nvme_path, run.global_rank).rglob("*")
    nbytes = sum(f.stat().st_size for f in files if f.is_file())
    return ("optimizer" if config.offload_optimizer == "nvme" else "parameters"), nbytes


def clear(config: Any, run: RunContext) -> None:
    """Remove this rank's swap files (the end of every Trainer call and Fabric set-up)."""
    if config.nvme_path is not None:
        offload.clear_swap(config.nvme_path, run.global_rank)
