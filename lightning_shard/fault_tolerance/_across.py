"""The cross-group gradient mean, once per backward (:class:`AcrossGroups`): at stages 0-1 DDP's communication
hook takes each bucket's mean inside the group, at stages 2-3 FSDP2's reduce-scatter each unit's; once the
backward has ended every gradient (this rank's shard of it) is averaged over the replica groups taking part, in
the module's parameter order, a few large all-reduces rather than one per bucket or unit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from lightning_shard._dtensor import laid_out_as
from lightning_shard._dtensor import local as _local


class AcrossGroups:
    """The hooks under fault tolerance: DDP's communication hook (the group's mean of each bucket, ``within``)
    and FSDP2's all-reduce hook (:meth:`shard_reduced`); once the backward has ended, every gradient's mean
    over the participating groups, in the module's parameter order.

    Not per bucket: DDP rebuilds its buckets after its first backward, in the order the gradients became
    ready, so a restarted group's first backward (the initial buckets) meets the live groups' rebuilt ones,
    and bucket ``k`` holds other parameters, or the same ones in another order, on each side: a sum of unlike
    buffers, after which every group trains its own model. Not per FSDP2 unit either: a round trip to every
    group per unit. The mean is HSDP's, its division by the group's size taken before the cross-group sum
    rather than after: the same bits where the sizes are powers of two.
    """

    def __init__(
        self,
        manager: Any,
        module: nn.Module,
        waited: Callable[[float], None],
        within: Callable[..., Any] | None = None,
    ) -> None:
        """``manager``: torchft's; ``waited(seconds)`` is told how long each cross-group mean took; ``within``:
        DDP's own hook (stages 0-1)."""
        self.manager, self.within, self.module, self.waited = manager, within, module, waited
        #: The backward (autograd's graph task id) whose mean is queued: a backward that raised after queuing it
        #: never ran it, and the next one queues its own.
        self._queued: int | None = None
        self.__name__ = self.__qualname__ = "fault_tolerant_allreduce_hook"  # DDP reads and logs the name

    def __call__(self, group, bucket):  # type: ignore[no-untyped-def]  # (no annotations: DDP checks them)
        if bucket.index() == 0:  # the first bucket of a synchronised backward (DDP launches them in order)
            Variable._execution_engine.queue_callback(self._after_ddp)
        assert self.within is not None
        return self.within(group, bucket)

    def shard_reduced(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook (``set_all_reduce_hook``), called with each unit's reduce-scattered shard in a
        backward that syncs. FSDP2 queued its end-of-backward callback (which assigns the last units' shards
        to the gradients) at the backward's start: queued from here, the mean runs after it."""
        task = torch._C._current_graph_task_id()
        if self._queued != task:
            self._queued = task
            Variable._execution_engine.queue_callback(self.across)

    def _after_ddp(self) -> None:
        # DDP queues its own end-of-backward callback (which writes each bucket's mean into the gradients) once
        # its last bucket is launched, after the one queued above: queued from here, this one runs after it.
        Variable._execution_engine.queue_callback(self.across)

    def across(self) -> None:
        self._queued = None
        started = time.perf_counter()
        average_gradients(self.manager, self.module)
        self.waited(time.perf_counter() - started)


#: The most bytes of gradients one cross-group all-reduce carries (DDP's default bucket size).
CHUNK_BYTES = 25 * 1024 * 1024


def chunked(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` in flat all-reduce chunks: in order, one dtype and device each, at most
    :data:`CHUNK_BYTES` (a larger tensor alone)."""
    chunks: list[list[int]] = []
    open_chunk: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        held = open_chunk.get(key)
        if held is None or 0 < held[1] and held[1] + nbytes > CHUNK_BYTES:
            held = ([], 0)
            chunks.append(held[0])
        held[0].append(i)
        open_chunk[key] = (held[0], held[1] + nbytes)
    return chunks


def average_gradients(manager: Any, module: nn.Module) -> None:
    """Each gradient of ``module``'s trainable parameters (this rank's shard of a DTensor's) averaged over the
    participating groups, in parameter order, in chunks of at most 25 MB per dtype. A parameter without a
    gradient counts as zeros and gets the mean where another group had one (DDP's rule for an unused
    parameter), else stays without."""
    params = [p for p in module.parameters() if p.requires_grad]
    chunks = [[params[i] for i in chunk] for chunk in chunked([_local(p) for p in params])]
    pending = []
    for chunk in chunks:
        # [sum of numels + one presence flag per parameter]
        flat = torch.cat(
            [
                (_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                for p in chunk
            ]
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
                local = _local(p)
                mean = flat[offset : offset + local.numel()].view_as(local)
                offset += local.numel()
                if p.grad is not None:
                    _local(p.grad).copy_(mean)
                elif flag > 0:
                    p.grad = laid_out_as(mean.clone(), p) if isinstance(p, DTensor) else mean.clone()
