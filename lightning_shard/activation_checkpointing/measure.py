"""Measuring what activation checkpointing trades: activation bytes against recompute FLOPs.

Bytes are read at the allocator, not from saved-tensor hooks: selective checkpointing keeps its
saved op outputs in its own cache, which saved-tensor hooks never see. On CUDA the caching
allocator's ``memory_allocated`` is exact; on CPU there is no allocator counter, so the forward runs
under ``torch.profiler`` with memory profiling and the bytes are the sum of every allocation minus
every free (the self memory of all profiler events). Checked: under ``torch.no_grad`` that sum is
exactly the size of the output, i.e. temporaries freed inside the forward cancel out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from lightning_shard.activation_checkpointing.flops import count_recompute_flops
from lightning_shard.activation_checkpointing.wrap import buffers_kept


@dataclass(frozen=True)
class Measurement:
    """One forward + backward of a module, as :func:`measure` saw it."""

    activation_bytes: int
    """Bytes the forward pass leaves allocated for backward: saved activations, tensors kept by the
    selective policy, inputs kept by checkpoints, and the output itself."""
    forward_flops: int
    """FLOPs of the forward pass (``torch.utils.flop_counter`` formulas: matmuls, convolutions, attention)."""
    backward_flops: int
    """FLOPs of the gradient computation, not counting the recompute."""
    recompute_flops: int
    """Forward FLOPs that checkpointed blocks re-ran inside backward: the compute paid for the memory saved."""


def measure(module: nn.Module, batch: Any) -> Measurement:
    """Run ``module`` forward and backward once on ``batch`` and report activation bytes and FLOPs.

    ``batch`` is the module's input: a tensor is passed as ``module(batch)``, a tuple or list as
    ``module(*batch)`` and a dict as ``module(**batch)``. The loss is the sum of all floating-point
    outputs; gradients are taken with ``torch.autograd.grad``, so ``.grad`` of the parameters is left
    untouched, and the RNG state and the buffers (BatchNorm running statistics) are restored afterwards, so
    measuring does not change a training run.
    """
    args, kwargs = _as_call(batch)
    device = device_of(module, args, kwargs)
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type),
        buffers_kept(module),
    ):
        # Warm-up: lazy initialisation and any memory_budget planning happen here, not in the measured pass.
        module(*args, **kwargs)
        output, activation_bytes = allocated_by(lambda: module(*args, **kwargs), device)
        del output  # frees the graph and everything the forward saved
        # One tally spans forward and backward: checkpoint fixes its recompute context in the forward.
        with count_recompute_flops() as recompute:
            with FlopCounterMode(display=False) as forward_counter:
                output = module(*args, **kwargs)
            loss = _scalar_loss(output)
            targets: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
            targets += [t for t in _tensors((args, kwargs)) if t.requires_grad]
            backward_total = 0
            if loss is not None and targets:
                with FlopCounterMode(display=False) as backward_counter:
                    torch.autograd.grad(loss, targets, allow_unused=True)
                backward_total = backward_counter.get_total_flops()
    return Measurement(
        activation_bytes=int(activation_bytes),
        forward_flops=int(forward_counter.get_total_flops()),
        backward_flops=int(backward_total - recompute.flops),
        recompute_flops=int(recompute.flops),
    )


def allocated_by(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """Run ``fn`` and return its result and the bytes it left allocated on ``device``."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        out = fn()
        return out, torch.cuda.memory_allocated(device) - before
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        raise RuntimeError(
            "Measuring activation bytes on CPU runs torch.profiler, but a profiler is already running"
            " (e.g. Trainer(profiler='pytorch')). Measure outside the profiled region, or, for"
            " ActivationCheckpointing(memory_budget=...), start the profiler after the first training step."
        )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(event.self_cpu_memory_usage for event in prof.events())


def _as_call(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def device_of(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for tensor in _tensors((args, kwargs)):
        return tensor.device
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors nested in tuples, lists and dicts (including ``ModelOutput``-style dict subclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)


def _scalar_loss(output: Any) -> torch.Tensor | None:
    parts = [t.float().sum() for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    return torch.stack(parts).sum() if parts else None
