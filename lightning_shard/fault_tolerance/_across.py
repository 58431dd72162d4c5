"""The cross-group gradient mean at stages 0-1 (DDP): DDP's communication hook takes each bucket's mean inside
the group, and once DDP's backward has ended every gradient is averaged over the replica groups taking part,
in the module's parameter order (:class:`AcrossGroups`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable


class AcrossGroups:
    """DDP's communication hook under fault tolerance: the group's mean of each bucket (``within``); then, once
    DDP has finished the backward, every gradient's mean over the participating groups, in the module's
    parameter order.

    Not per bucket: DDP rebuilds its buckets after its first backward, in the order the gradients became
    ready, so a restarted group's first backward (the initial buckets) meets the live groups' rebuilt ones,
    and bucket ``k`` holds other parameters, or the same ones in another order, on each side: a sum of unlike
    buffers, after which every group trains its own model."""

    def __init__(
        self, manager: Any, within: Callable[..., Any], module: nn.Module, waited: Callable[[float], None]
    ) -> None:
        """``manager``: torchft's; ``waited(seconds)`` is told how long each cross-group mean took."""
        self.manager, self.within, self.module, self.waited = manager, within, module, waited
        self.__name__ = self.__qualname__ = "fault_tolerant_allreduce_hook"  # DDP reads and logs the name

    def __call__(self, group, bucket):  # type: ignore[no-untyped-def]  # (no annotations: DDP checks them)
        if bucket.index() == 0:  # the first bucket of a synchronised backward (DDP launches them in order)
            Variable._execution_engine.queue_callback(self._after_ddp)
        return self.within(group, bucket)

    def _after_ddp(self) -> None:
        # DDP queues its own end-of-backward callback (which writes each bucket's mean into the gradients) once
        # its last bucket is launched, after the one queued above: queued from here, this one runs after it.
        Variable._execution_engine.queue_callback(self.across)

    def across(self) -> None:
        started = time.perf_counter()
        average_gradients(self.manager, self.module)
        self.waited(time.perf_counter() - started)


#: The most bytes of gradients one cross-group all-reduce carries (DDP's default bucket size).
_CHUNK_BYTES = 25 * 1024 * 1024


def average_gradients(manager: Any, module: nn.Module) -> None:
    """Each gradient of ``module``'s trainable parameters averaged over the participating groups, in parameter
    order, in chunks of at most 25 MB per dtype. A parameter without a gradient counts as zeros and gets the
    mean where another group had one (DDP's rule for an unused parameter), else stays without."""
    params = [p for p in module.parameters() if p.requires_grad]
    chunks: list[list[nn.Parameter]] = []
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    open_chunk: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if key not in open_chunk or 0 < sizes[key] and sizes[key] + nbytes > _CHUNK_BYTES:
            open_chunk[key] = []
            chunks.append(open_chunk[key])
            sizes[key] = 0
        open_chunk[key].append(p)
        sizes[key] += nbytes
    pending = []
    for chunk in chunks:
        # [sum of numels + one presence flag per parameter]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in chunk]
            + [
                torch.tensor(
                    [float(p.grad is not None) for p in chunk], dtype=chunk[0].dtype, device=chunk[0].device
                )
            ]
        )
        pending.append((chunk, flat, manager.allreduce(flat)))
    for chunk, flat, work in pending:
        work.wait()
        offset, present = 0, flat[-len(chunk) :]
        with torch.no_grad():
            for p, flag in zip(chunk, present.tolist(), strict=True):
                mean = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(mean)
                elif flag > 0:
                    p.grad = mean.clone()
