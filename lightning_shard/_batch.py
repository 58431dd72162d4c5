"""What a batch holds: its number of samples and tokens, read off its first tensor.

Shared by the MFU monitor (tokens per second) and ``ShardStrategy(stage="auto")`` (the micro-batch and
sequence length the planner needs), so neither the core nor the callbacks import the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        values = [batch["input_ids"], *batch.values()] if "input_ids" in batch else list(batch.values())
        return next((t for t in map(_first_tensor, values) if t is not None), None)
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return next((t for t in map(_first_tensor, batch) if t is not None), None)
    return None


def batch_shape(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch from its first tensor (``input_ids`` first in a dict).

    Tokens are samples x sequence length when that tensor holds integer ids of shape (B, T, ...);
    float inputs such as images have no tokens (None).
    """
    t = _first_tensor(batch)
    if t is None or t.dim() == 0:
        return 1, None
    samples = int(t.shape[0])
    is_ids = not (t.is_floating_point() or t.is_complex())
    return samples, (samples * int(t.shape[1]) if is_ids and t.dim() >= 2 else None)
