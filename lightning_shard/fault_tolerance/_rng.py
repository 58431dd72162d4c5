"""The process's random generators as a healing peer sends them (tensors and plain values only)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The process's random generators (torch, Python, NumPy), in tensors and plain values only."""
    numpy: Any = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy[0], torch.from_numpy(numpy[1].astype(np.int64)), *numpy[2:]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` gave (a peer's)."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = state["numpy"]
    np.random.set_state((numpy[0], numpy[1].numpy().astype(np.uint32), *numpy[2:]))
