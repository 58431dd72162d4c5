"""Bytes one rank holds, read off the shards the set-up built (on the meta device or allocated: the same count).

- parameters: each parameter's local shard (a DTensor's ``_local_tensor``), at FSDP2's padded size where FSDP2
  holds it: a dimension of ``n`` rows split over ``s`` ranks gives every rank ``ceil(n / s)`` rows, the last
  ones padding;
- gradients: one per trainable parameter, in the parameter's layout and dtype (FSDP2 reduce-scatters into a
  buffer of the padded shards; DDP keeps a full local gradient);
- optimizer state: every tensor the optimizer keeps per parameter after a step (AdamW: ``exp_avg``,
  ``exp_avg_sq`` of the local shard's shape, unpadded, and a one-element ``step``);
- the checkpoint: the chunks torch.distributed.checkpoint's planner writes for this rank's state dict, a chunk
  that several ranks hold (replicated, or the same shard on every tensor-parallel rank) shared evenly among
  them, as DCP's deduplication balances it; one ``__<rank>_0.distcp`` file per rank (``FileSystemWriter``'s
  default), rank 0 also writes ``.metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_shard import _compat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class HeldBytes:
    """Model state on one rank."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    params: int
    """Elements of the parameter shards (padding included)."""

    @property
    def model_state(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def inner_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds the state: ZeRO-1's ``ZeroRedundancyOptimizer`` keeps its partition's in
    ``optim``."""
    return getattr(optimizer, "optim", optimizer)


def optimizer_bytes(optimizers: list[Optimizer]) -> int:
    """Every tensor of every optimizer's state, its local part."""
    total = 0
    for optimizer in optimizers:
        for state in inner_optimizer(optimizer).state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = _local(value)
                    total += local.numel() * local.element_size()
    return total


def held_bytes(model: nn.Module, optimizers: list[Optimizer]) -> HeldBytes:
    """Parameters, gradients and optimizer state of ``model`` on this rank (see the module's docstring)."""
    padded = _compat.fsdp_padded_shards(model)
    params = grads = elements = 0
    for param in model.parameters():  # a tied parameter is yielded once
        local = _local(param)
        numel = padded.get(id(param), local.numel())
        nbytes = numel * local.element_size()
        params += nbytes
        elements += numel
        if param.requires_grad:
            grads += nbytes
    return HeldBytes(params, grads, optimizer_bytes(optimizers), elements)


def collective_bytes(model: nn.Module, held: HeldBytes, data_parallel: int) -> dict[str, int]:
    """The bytes the data-parallel collectives of one step move on this rank, from the shards (no step is
    traced): each FSDP2 unit all-gathers its padded shards from its shard group once in forward and, where
    forward reshards it (stage 3), again in backward; reduce-scatters the gradients; all-reduces them across
    HSDP's replicas; parameters outside FSDP2 (DDP) all-reduce their gradients. Sizes are the collective's
    whole buffer (all-gather's output, reduce-scatter's input), in the precision policy's dtypes. The traffic
    of activations (tensor, expert, context and pipeline parallelism) needs a traced step: not counted."""
    counted = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    units = _compat.fsdp_units(model)
    for unit in units:
        whole = unit["elements"] * unit["shard"]
        if unit["shard"] > 1:
            counted["all_gather"] += (2 if unit["reshards"] else 1) * whole * unit["gather_bytes"]
            counted["reduce_scatter"] += whole * unit["reduce_bytes"]
        if unit["replicate"] > 1:
            counted["all_reduce"] += unit["elements"] * unit["reduce_bytes"]
    if not units and data_parallel > 1:  # DDP (stages 0-1): every gradient all-reduced
        counted["all_reduce"] += held.grad_bytes
    return counted


def _holders(value: DTensor, stage_ranks: int) -> int:
    """The ranks of one pipeline stage that hold the same chunk of ``value``."""
    mesh, distinct = value.device_mesh, 1
    for dim, placement in enumerate(value.placements):
        if not placement.is_replicate() and not placement.is_partial():
            distinct *= mesh.size(dim)
    return max(1, stage_ranks // distinct)


def checkpoint_writes(state_dict: dict[str, Any], rank: int, stage_ranks: int) -> tuple[list[str], int]:
    """The files and bytes this rank writes in a sharded checkpoint of ``state_dict``.

    The state dict is flattened as torch.distributed.checkpoint's planner flattens it; what DCP writes of a
    DTensor is its local tensor, of a plain tensor the whole of it (once among the ranks of a stage). The
    planner's own chunk placement is not run: it is O(world size) per ``_StridedShard`` tensor (seconds per rank
    at thousands of ranks), and it places chunks from the mesh's coordinates, which torch's caches (keyed by
    meshes equal on every rank) may answer with another rank's when several ranks are played in one process.
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=rank == 0)
    total = 0.0
    for value in planner.state_dict.values():
        if isinstance(value, DTensor):
            local = value._local_tensor
            total += local.numel() * local.element_size() / _holders(value, stage_ranks)
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size() / stage_ranks
    files = [f"__{rank}_0.distcp"] if planner.state_dict else []
    if rank == 0:
        files.append(".metadata")
    return files, round(total)
