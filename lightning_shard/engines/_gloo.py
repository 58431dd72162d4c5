"""FSDP2's gradient reduce-scatter on gloo groups (CPU ranks) as an all-to-all and a local sum.

Gloo has no reduce-scatter of its own: torch runs ``reduce_scatter_tensor`` on a gloo group as an
all-reduce of the whole buffer, then keeps this rank's chunk. Each rank then sends and receives twice
what a reduce-scatter needs. An all-to-all sends rank j the j-th chunk of every rank's gradients, and
the sum of the N chunks received is this rank's shard: (N - 1) / N of the buffer each way, as a ring
reduce-scatter. Installed through FSDP2's public ``FSDPModule.set_custom_reduce_scatter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

try:  # the interface ``FSDPModule.set_custom_reduce_scatter`` takes; torch does not re-export it
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover  (moved: FSDP2's own reduce-scatter is used)
    ReduceScatter = None  # type: ignore[assignment,misc]


class AllToAllReduceScatter(ReduceScatter or object):  # type: ignore[misc]
    """``SUM`` / ``AVG`` reduce-scatter of a flat buffer as ``all_to_all_single`` plus a sum; any other op
    goes to ``reduce_scatter_tensor``."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        n = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(n, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
        return None


def use_all_to_all_reduce_scatter(module: FSDPModule) -> bool:
    """On a module ``fully_shard`` wrapped over a gloo group, reduce-scatter gradients as above."""
    if ReduceScatter is None:  # pragma: no cover
        return False
    try:  # FSDP2's private state: where it moved, its own reduce-scatter stays
        groups = module._get_fsdp_state()._fsdp_param_groups
        pg = getattr(groups[0].mesh_info, "shard_process_group", None) if len(groups) == 1 else None
    except AttributeError:  # pragma: no cover
        return False
    if pg is None or dist.get_backend(pg) != "gloo" or pg.size() == 1:
        return False
    module.set_custom_reduce_scatter(AllToAllReduceScatter())
    return True
