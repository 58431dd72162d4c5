"""Clipping by the global gradient norm when parameters live on different meshes.

With tensor parallelism, the split layers' parameters are DTensors on ``(data-parallel, tp)`` while the
rest are on the data-parallel mesh alone, and torch's ``clip_grad_norm_`` cannot stack norms from two
meshes. Every element of a gradient is held by ``world / shards`` ranks (its copies), so the squared
norm is one sum over all ranks of each rank's local squares divided by that count: one all-reduce.
With ``P`` pipeline stages a parameter lives only on its stage's ``world / P`` ranks, so its copies are
``world / (P x shards)``; the same all-reduce then sums every stage's parameters once (the global norm).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_shard._modules import SPLIT_OVER, TIED_COPY


def shard_count(tensor: Tensor) -> int:
    """How many ranks split the elements of ``tensor`` (1 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 1
    count = 1
    for dim, placement in enumerate(tensor.placements):
        # Split along this mesh dimension: Shard, and FSDP2's strided shard over a tensor-parallel split.
        if not (placement.is_replicate() or placement.is_partial()):
            count *= tensor.device_mesh.size(dim)
    return count


def grad_norm(parameters: Iterable[Tensor], pipeline_stages: int = 1) -> Tensor:
    """The global 2-norm of the gradients of ``parameters`` (every rank passes all of its parameters; with
    ``pipeline_stages`` > 1, all of its stage's)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total: Tensor | None = None
    for p in parameters:
        g = p.grad
        if g is None or getattr(
            p, TIED_COPY, False
        ):  # a tied parameter's later copy: counted on its first stage
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        shards = getattr(p, SPLIT_OVER, None) or shard_count(g)
        squares = local.detach().double().pow(2).sum() * (shards * pipeline_stages / world)
        total = squares if total is None else total + squares.to(total.device)
    if total is None:  # no gradient here: still join the all-reduce, on the device the backend uses
        nccl = world > 1 and dist.get_backend() == "nccl"
        total = torch.zeros((), dtype=torch.float64, device="cuda" if nccl else "cpu")
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, pipeline_stages: int = 1) -> Tensor:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params, pipeline_stages)
    # A 0-dim float32 factor: multiplies gradients of any dtype in place, on any device, without a sync.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()
    for p in params:
        g = p.grad
        assert g is not None
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coefficient)
    return norm.float()


__all__ = ["clip_grad_norm_", "grad_norm"]
