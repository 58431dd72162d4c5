"""How many bytes of model state this rank holds: parameters, gradients, optimizer state.

What each ZeRO stage should hold per rank is the table in docs/strategy.md ("Memory per rank");
this module measures what is actually resident, so tests and the planner can check the table
against real runs. Sharded (DTensor) tensors count their local shard; a storage shared by several
tensors (tied weights) is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state resident on this rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself (no autograd
    node is recorded: also usable while saved-tensor hooks run)."""
    if not hasattr(tensor, "to_local"):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """This rank's bytes of ``tensors``, each counted once (views into one buffer, e.g. FSDP2's
    reduce-scatter output holding several gradients, count their own parts)."""
    return _count(tensors, set())


def _count(tensors: Iterable[torch.Tensor], seen: set[tuple[int, int]]) -> int:
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        if local.device.type == "meta":
            continue
        key = (int(local.untyped_storage().data_ptr()), int(local.storage_offset()))
        if key in seen and local.numel() > 0:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _inner_optimizer(optimizer: Optimizer) -> Optimizer:
    inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps this rank's partition in .optim


def model_state_bytes(module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds for ``module``."""
    params = list(module.parameters())
    seen: set[tuple[int, int]] = set()
    param_bytes = _count(params, seen)
    grad_bytes = _count((p.grad for p in params if p.grad is not None), seen)
    state_tensors = [
        value
        for optimizer in optimizers
        for state in _inner_optimizer(optimizer).state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    ]
    return StateBytes(param_bytes, grad_bytes, _count(state_tensors, seen))
