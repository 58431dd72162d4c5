"""FSDP2's collectives on gloo groups (CPU ranks): through shared memory among ranks on one host, else
the gradient reduce-scatter as an all-to-all and a local sum.

Shared memory (``_shm.py``) carries the all-gather of parameters and the reduce-scatter of gradients
wherever every rank of the group can map the others' files in ``/dev/shm``. Elsewhere (ranks on several
hosts) the all-gather is gloo's, and the reduce-scatter an all-to-all: gloo has no reduce-scatter of its
own, and torch runs ``reduce_scatter_tensor`` on a gloo group as an all-reduce of the whole buffer, then
keeps this rank's chunk, so each rank sends and receives twice what a reduce-scatter needs. An all-to-all
sends rank j the j-th chunk of every rank's gradients, and the sum of the N chunks received is this rank's
shard: (N - 1) / N of the buffer each way, as a ring reduce-scatter. Installed through FSDP2's public
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``.

Float8 weights (``ShardStrategy(fp8=...)`` at stages 2-3) are gathered as their bytes: gloo has no float8
dtype (``RuntimeError: Invalid scalar type``), and a byte copy is exactly what a gather of them is. The
bytes every all-gather here delivers to this rank are counted in :data:`traffic`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_shard.engines._shm import shared_memory_group

try:  # FSDP2's own collectives (what ``set_custom_all_gather`` / ``_reduce_scatter`` replace); private path
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # pragma: no cover  (moved: FSDP2's own collectives are used)
    DefaultAllGather = DefaultReduceScatter = None  # type: ignore[assignment,misc]


class Traffic:
    """Bytes the FSDP2 all-gathers of this process have delivered (the whole output, every rank's chunk)."""

    def __init__(self) -> None:
        self.all_gather_bytes = 0
        self.all_gathers = 0

    def reset(self) -> None:
        self.all_gather_bytes = self.all_gathers = 0


#: This process's all-gather bytes (read by tests and benchmarks: bytes gathered per step).
traffic = Traffic()
_FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class CpuAllGather(DefaultAllGather or object):  # type: ignore[misc]
    """All-gather through shared memory where the group's ranks share a host, else FSDP2's own (gloo's);
    float8 buffers travel as uint8."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if output_tensor.dtype in _FLOAT8:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        traffic.all_gather_bytes += output_tensor.nbytes
        traffic.all_gathers += 1
        shm = shared_memory_group(group)
        if shm is not None and shm.all_gather(output_tensor, input_tensor):
            return None
        return super().__call__(output_tensor, input_tensor, group, async_op)


class CpuReduceScatter(DefaultReduceScatter or object):  # type: ignore[misc]
    """``SUM`` / ``AVG`` reduce-scatter of a flat buffer through shared memory where the group's ranks share
    a host (unless ``shared_memory=False``), else as ``all_to_all_single`` plus a sum; any other op goes to
    FSDP2's own (gloo's)."""

    def __init__(self, shared_memory: bool = True) -> None:
        self.shared_memory = shared_memory

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        shm = shared_memory_group(group) if self.shared_memory else None
        if shm is not None and shm.reduce_scatter(output_tensor, input_tensor, op):
            return None
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        n = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(n, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
        return None


def use_cpu_collectives(module: FSDPModule) -> bool:
    """On a module ``fully_shard`` wrapped over a gloo group, all-gather and reduce-scatter as above."""
    if DefaultReduceScatter is None or DefaultAllGather is None:  # pragma: no cover
        return False
    try:  # FSDP2's private state: where it moved, its own reduce-scatter stays
        groups = module._get_fsdp_state()._fsdp_param_groups
        pg = getattr(groups[0].mesh_info, "shard_process_group", None) if len(groups) == 1 else None
    except AttributeError:  # pragma: no cover
        return False
    if pg is None or dist.get_backend(pg) != "gloo" or pg.size() == 1:
        return False
    module.set_custom_all_gather(CpuAllGather())
    module.set_custom_reduce_scatter(CpuReduceScatter())
    return True
