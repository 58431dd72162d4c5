"""Skip optimizer steps whose loss or gradients are NaN/inf on any rank, together.

One rank seeing a non-finite value must not step while another does: the replicas (or shards)
would silently diverge. The decision is one all-reduce (MAX) of a flag, so every rank skips the
same steps. Consecutive skips are bounded: a run that keeps producing NaNs is broken, and
stopping it with a clear error beats spending the cluster on no-op steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.memory import local_tensor


class NonFiniteGuard:
    """Counts and bounds skipped steps. ``max_skipped``: consecutive skips allowed before raising."""

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = max_skipped
        self.consecutive = 0
        self.total = 0

    def should_skip(
        self, loss: Tensor | None, params: Iterable[Tensor], device: torch.device, check_grads: bool = True
    ) -> bool:
        bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        if check_grads and not bad:
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            # One reduction over all gradients, so one device sync per step, not one per parameter.
            finite = [torch.isfinite(g).all() for g in grads if g.numel()]
            bad = bool(finite) and not bool(torch.stack(finite).all())
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        if self.consecutive > self.max_skipped:
            raise RuntimeError(
                f"ShardStrategy(skip_nonfinite=True, max_skipped={self.max_skipped}): {self.consecutive} consecutive"
                " steps had a non-finite loss or gradient; stopping. Lower the learning rate, check the data, or"
                " raise max_skipped."
            )
        return True
