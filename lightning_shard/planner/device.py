"""How much memory one rank may plan with, read from the machine: free CUDA memory, or its share of RAM."""

from __future__ import annotations

import os

import torch


def available_device_memory(device: torch.device | str, local_world_size: int | None = None) -> int:
    """Bytes one rank may plan with: free CUDA memory of ``device``, or available RAM on a CPU.

    On a CPU every rank of the host shares the RAM, so it is divided by ``local_world_size`` (default:
    the ``LOCAL_WORLD_SIZE`` environment variable torchrun sets, else 1).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise ValueError(
            f"available_device_memory(device={str(device)!r}) supports 'cuda' and 'cpu'. Pass device_memory"
            " to the planner yourself for other devices."
        )
    ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return _available_ram() // max(1, ranks)


def _available_ram() -> int:
    try:
        import psutil  # optional: psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
