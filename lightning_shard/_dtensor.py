"""A rank's part of a DTensor, and a rank's tensor put back in a DTensor's layout: shared by what moves shards in
and out of DTensors (gradients averaged across replica groups, optimizer state, fp8's wrapped shards)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor (a view), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def laid_out_as(shard: torch.Tensor, like: DTensor) -> DTensor:
    """``shard`` (this rank's part) as a DTensor of ``like``'s mesh, placements, global shape and stride."""
    return DTensor.from_local(
        shard, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
