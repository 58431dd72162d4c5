"""Elementwise optimizers stepped on the local shards of DTensor parameters (FSDP2, tensor parallel).

An optimizer built over FSDP2's parameters steps one DTensor per parameter: every arithmetic op of the
update goes through DTensor's dispatch (sharding propagation, a local op, a new DTensor), which on a CPU
costs more than the arithmetic (the AdamW step of the 6 x 256 GPT took 12 ms over DTensors against
DeepSpeed's 2 ms over one flat partition; benchmarks/bench_engines.py --profile). For an optimizer whose
update is elementwise (SGD, Adam, AdamW, ...) and gradients sharded exactly as their parameters, the
DTensor ops run the same local op on each shard: the step here runs those ops on the shards directly,
and the result is bit-equal. Optimizer state stays DTensors between steps, so checkpoints, resharding
and ``get_optimizer_state_dict`` see what they would without it.

Anything else falls back to the DTensor step, which is exact for every optimizer: a subclass or any
other optimizer class (its update may need whole tensors: norms, factored moments, orthogonalisation),
a gradient placed differently from its parameter (a tensor-parallel ``Partial`` gradient is summed by the
DTensor step), and optimizers with step hooks (they would see the shards).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_shard._dtensor import laid_out_as

#: Optimizer classes whose update of each element reads only that element (and scalars).
ELEMENTWISE: frozenset[type[Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)

_MARK = "_lightning_shard_local_step"


def step_on_local_shards(optimizer: Optimizer) -> bool:
    """Make ``optimizer.step`` run on the local shards of its DTensor parameters where that is exact.

    Returns whether the optimizer was set up for it (an elementwise optimizer class, not a subclass, with
    DTensor parameters); each step still checks the gradients' placements and falls back when needed.
    """
    if type(optimizer) not in ELEMENTWISE or getattr(optimizer, _MARK, False):
        return False
    if not any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        return False
    step = optimizer.step

    def local_step(self: Optimizer, closure: Any = None, **kwargs: Any) -> Any:
        if not _exact_on_shards(self):
            return step(closure, **kwargs)
        loss = None
        if closure is not None:  # evaluated first, as the optimizers' own step does
            with torch.enable_grad():
                loss = closure()
        with _on_shards(self):
            step(**kwargs)
        return loss

    # A bound method: torch's LR schedulers wrap ``optimizer.step.__func__`` when built after this.
    optimizer.step = types.MethodType(functools.wraps(step)(local_step), optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _MARK, True)
    return True


def _has_step_hooks(optimizer: Optimizer) -> bool:
    """Step hooks on this optimizer or on every optimizer. torch keeps both under private names: where
    one cannot be read, hooks are assumed and the DTensor step kept."""
    hooks = [
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
    ]
    return any(h is None or len(h) > 0 for h in hooks)


def _exact_on_shards(optimizer: Optimizer) -> bool:
    """No step hooks, and every gradient laid out as its parameter: the same mesh, placements, global shape
    (hence the same local shape), dtype and device. Read from the DTensors' metadata alone."""
    if _has_step_hooks(optimizer):
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None or not isinstance(p, DTensor):
                continue
            if not isinstance(grad, DTensor) or grad.is_sparse:
                return False
            if (grad.device_mesh, grad.placements, grad.shape) != (p.device_mesh, p.placements, p.shape):
                return False
            if grad.dtype != p.dtype or grad.device != p.device:
                return False
    return True


@contextmanager
def _on_shards(optimizer: Optimizer) -> Generator[None, None, None]:
    """Inside: the optimizer's groups and state hold the local shards (the same storage).

    Under ``no_grad``, ``DTensor.to_local()`` is the local tensor itself, with no autograd op around it.
    """
    swapped: list[tuple[dict[str, Any], list[Any]]] = []
    shards: list[tuple[DTensor, torch.Tensor, dict[str, Any]]] = []
    try:
        with torch.no_grad():
            _swap_in(optimizer, swapped, shards)
        yield
    finally:
        for group, params in swapped:
            group["params"] = params
        with torch.no_grad():
            for p, shard, before in shards:
                shard.grad = None
                after = optimizer.state.pop(shard, {})
                if after or before:
                    optimizer.state[p] = {
                        k: _as_dtensor(v, p, shard, before.get(k)) for k, v in after.items()
                    }


def _swap_in(
    optimizer: Optimizer,
    swapped: list[tuple[dict[str, Any], list[Any]]],
    shards: list[tuple[DTensor, torch.Tensor, dict[str, Any]]],
) -> None:
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        local = []
        for p in params:
            if not isinstance(p, DTensor):
                local.append(p)
                continue
            shard = p.to_local()
            shard.grad = None if p.grad is None else p.grad.to_local()  # type: ignore[attr-defined]
            before = state.pop(p, {})
            state[shard] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in before.items()}
            shards.append((p, shard, before))
            local.append(shard)
        swapped.append((group, params))
        group["params"] = local


def _as_dtensor(value: Any, p: DTensor, shard: torch.Tensor, before: Any) -> Any:
    """A state entry back in the parameter's placement (the same DTensor object where it was one)."""
    if isinstance(before, DTensor) and before.to_local() is value:
        return before
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape:
        return laid_out_as(value, p)
    return value
