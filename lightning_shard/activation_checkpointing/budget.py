"""``memory_budget``: choose which blocks to recompute, and how, so activations fit a fraction of the no-checkpoint size.

The plan is made lazily, on the first training call of a block of each class, because that is the
first moment the real input shapes are known. That one block is run once per candidate mode on a
detached copy of its inputs (RNG forked, so the training run's dropout masks do not move) and the
allocator tells what each mode leaves allocated:

    bytes[m]   activation bytes of one block in mode m (m in none / selective / full)
    flops[m]   forward FLOPs the mode re-runs in backward: 0 for none, the block's forward for full,
               the forward minus the saved ops' FLOPs for selective

With n blocks of the class, the plan picks counts (n_none, n_sel, n_full) minimising
``n_sel * flops[selective] + n_full * flops[full]`` subject to
``n_none * bytes[none] + n_sel * bytes[selective] + n_full * bytes[full] <= budget * n * bytes[none]``.
All blocks of a class are alike, so only the counts matter: an exhaustive search over O(n^2) pairs.
Ties are broken by checkpointing fewer blocks, then by memory: the selective policy often re-runs
zero *counted* FLOPs (it re-runs only elementwise ops, which FLOP formulas ignore), yet it still
costs time, so a loose budget should leave blocks alone rather than make them all selective.
Where in the stack a mode goes does not change the peak (every block's activations are alive at the
end of the forward); full recompute goes to the first blocks.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_shard.activation_checkpointing.measure import allocated_by, device_of
from lightning_shard.activation_checkpointing.modes import BlockMode
from lightning_shard.activation_checkpointing.policy import MATMUL_OVERLOADS
from lightning_shard.activation_checkpointing.wrap import CheckpointedForward, buffers_kept

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockCost:
    bytes: int
    recompute_flops: int


@dataclass(frozen=True)
class BlockPlan:
    """What the planner chose for one block class (kept on the planner for logs, tests and benchmarks)."""

    block_class: str
    modes: tuple[BlockMode, ...]
    costs: dict[str, BlockCost]
    budget_bytes: int
    planned_bytes: int
    fits: bool


class BudgetPlanner:
    """Shared by all wrappers of one ``apply_activation_checkpointing`` call that has a ``memory_budget``.

    A :class:`~.modes.ModeChooser`: each wrapper asks it for its mode on its first training call.
    """

    def __init__(self, budget: float, allow_selective: bool) -> None:
        self.budget = budget
        self.allow_selective = allow_selective
        self.groups: list[tuple[type[nn.Module], list[CheckpointedForward]]] = []
        self.plans: list[BlockPlan] = []

    def add(self, wrapper: CheckpointedForward) -> None:
        cls = type(wrapper.block)
        for group_cls, wrappers in self.groups:
            if group_cls is cls:
                wrappers.append(wrapper)
                return
        self.groups.append((cls, [wrapper]))

    def mode_for(self, wrapper: CheckpointedForward, args: tuple, kwargs: dict) -> BlockMode:
        planned = getattr(wrapper, "planned", None)
        if planned is None:
            self._plan(wrapper, args, kwargs)
            planned = wrapper.planned  # type: ignore[attr-defined]
        return planned

    def _plan(self, wrapper: CheckpointedForward, args: tuple, kwargs: dict) -> None:
        cls, group = next((c, ws) for c, ws in self.groups if any(w is wrapper for w in ws))
        modes: tuple[BlockMode, ...] = (
            ("none", "selective", "full") if self.allow_selective else ("none", "full")
        )
        costs = estimate_block(wrapper, args, kwargs, modes)
        chosen, fits = choose_modes(len(group), costs, self.budget)
        for member, mode in zip(group, chosen, strict=True):
            member.planned = mode  # type: ignore[attr-defined]
        budget_bytes = int(self.budget * len(group) * costs["none"].bytes)
        planned_bytes = sum(costs[m].bytes for m in chosen)
        plan = BlockPlan(cls.__qualname__, tuple(chosen), dict(costs), budget_bytes, planned_bytes, fits)
        self.plans.append(plan)
        if not fits:
            warnings.warn(
                f"ActivationCheckpointing(memory_budget={self.budget}) cannot be met for {cls.__qualname__} blocks:"
                f" even full recompute keeps {costs['full'].bytes / max(costs['none'].bytes, 1):.0%} of their"
                " no-checkpoint activations (each block keeps its input). Using policy='full' on every block;"
                " raise memory_budget to at least that fraction to silence this.",
                stacklevel=2,
            )
        log.info("activation checkpointing plan for %s: %s", cls.__qualname__, plan)


def estimate_block(
    wrapper: CheckpointedForward, args: tuple, kwargs: dict, modes: tuple[BlockMode, ...]
) -> dict[str, BlockCost]:
    """Bytes each mode leaves allocated for one block on these inputs, and the FLOPs it would recompute."""
    device = device_of(wrapper.block, args, kwargs)
    nbytes: dict[str, int] = {}
    # Extra forwards of the block on the first step: they must draw no random number and move no running statistic.
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type),
        buffers_kept(wrapper.block),
    ):
        for mode in modes:
            fresh_args, fresh_kwargs = _detached((args, kwargs))
            output, nbytes[mode] = allocated_by(
                functools.partial(wrapper.run_mode, mode, fresh_args, fresh_kwargs), device
            )
            del output
        fresh_args, fresh_kwargs = _detached((args, kwargs))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            wrapper.run_original(*fresh_args, **fresh_kwargs)
    per_op = counter.get_flop_counts().get("Global", {})
    forward = sum(per_op.values())
    saved_packets = {op.overloadpacket for op in wrapper.save_ops}
    matmul_packets = {op.overloadpacket for op in MATMUL_OVERLOADS}
    saved = 0
    for packet, flops in per_op.items():
        if packet in saved_packets:
            # every_other recomputes every second matmul: about half their FLOPs come back.
            share = 0.5 if wrapper.save_matmuls == "every_other" and packet in matmul_packets else 1.0
            saved += int(share * flops)
    recompute = {"none": 0, "selective": forward - saved, "full": forward}
    return {mode: BlockCost(nbytes[mode], recompute[mode]) for mode in modes}


def choose_modes(n: int, costs: dict[str, BlockCost], budget: float) -> tuple[list[BlockMode], bool]:
    """Cheapest mix of modes for ``n`` alike blocks under the budget: least recompute FLOPs, then fewest
    checkpointed blocks, then least memory."""
    limit = budget * n * costs["none"].bytes
    best: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    for n_full in range(n + 1):
        for n_sel in range(n - n_full + 1) if "selective" in costs else (0,):
            n_none = n - n_full - n_sel
            mem = n_none * costs["none"].bytes + n_full * costs["full"].bytes
            flops = n_full * costs["full"].recompute_flops
            if n_sel:
                mem += n_sel * costs["selective"].bytes
                flops += n_sel * costs["selective"].recompute_flops
            key = (flops, n_full + n_sel, mem)
            if mem <= limit and (best is None or key < best[0]):
                best = (key, (n_full, n_sel))
    if best is None:
        all_full: list[BlockMode] = ["full"] * n
        return all_full, False
    n_full, n_sel = best[1]
    modes: list[BlockMode] = ["full"] * n_full
    modes += ["selective"] * n_sel
    modes += ["none"] * (n - n_full - n_sel)
    return modes, True


def _detached(obj: Any) -> Any:
    """A copy of nested args whose tensors are new leaves (same storage) with the same requires_grad."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad and obj.is_floating_point())
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_detached(v) for v in obj)
    if isinstance(obj, list):
        return [_detached(v) for v in obj]
    return obj
