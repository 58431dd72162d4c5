"""Where a rank's share of the weights lives, for each kind of optimizer a strategy trains with.

An average is kept beside the weights the optimizer steps, as one more per-parameter entry of that
optimizer's state (``optimizer.state[p]["ema_weight"]``, fp32): whatever saves and loads the optimizer's
state per rank carries it too, and each rank averages only what it holds.

=====================================  =======================================  ===========================
optimizer the strategy steps            the tensors averaged (``truths``)         after writing them
=====================================  =======================================  ===========================
torch optimizer (DDP, none, FSDP2)      its parameters; DTensor: the local shard  nothing
``ZeroRedundancyOptimizer`` (stage 1)   the parameters this rank's partition owns broadcast from owners
DeepSpeed ZeRO-1/2                      the fp32 master partition of each group   copy to the model, gather
DeepSpeed ZeRO-3                        the fp32 master partition of each group   copy to ``ds_tensor``s
=====================================  =======================================  ===========================

Nothing here imports an engine: DeepSpeed's optimizers are recognised by the attributes they carry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

#: The optimizer-state entry holding a parameter's average.
KEY = "ema_weight"
#: DeepSpeed's fp32 master partitions: ZeRO-1/2's optimizer, then its BF16 optimizer.
_DEEPSPEED_MASTERS = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition")


class Layout:
    """A torch optimizer whose parameters are the weights: whole (DDP, one process) or DTensor shards."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def stateful(self) -> Optimizer:
        """The torch optimizer whose ``state`` is keyed by :meth:`truths` (and holds the averages)."""
        return self.optimizer

    def truths(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps on this rank, in a fixed order."""
        seen: dict[int, torch.Tensor] = {}
        for group in self.stateful.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def before_write(self) -> None:  # noqa: B027
        """Called before the truths are written (the model may hold gathered copies of them)."""

    def after_write(self) -> None:  # noqa: B027
        """Called after the truths were written: bring the model's own copies in line."""


class ZeroLayout(Layout):
    """Stage 1: ``ZeroRedundancyOptimizer``; each rank steps (and averages) the parameters it owns."""

    @property
    def stateful(self) -> Optimizer:
        return self.optimizer.optim  # type: ignore[attr-defined,no-any-return]

    def after_write(self) -> None:
        # Every rank's parameters from their owners, as ZeroRedundancyOptimizer.step() ends.
        self.optimizer._sync_params()  # type: ignore[attr-defined]


class DeepSpeedLayout(Layout):
    """DeepSpeed ZeRO-1/2 (and its BF16 optimizer, which DeepSpeed picks for ZeRO-1 with bf16): flat fp32
    master partitions, copied to the model's weights and gathered."""

    @property
    def stateful(self) -> Optimizer:
        return self.optimizer.optimizer  # type: ignore[attr-defined,no-any-return]

    def truths(self) -> list[torch.Tensor]:
        for name in _DEEPSPEED_MASTERS:
            if hasattr(self.optimizer, name):
                return list(getattr(self.optimizer, name))
        raise AssertionError("layout_of() chose this layout for an optimizer without master partitions")

    def after_write(self) -> None:
        self.optimizer.update_lp_params()  # type: ignore[attr-defined]


class DeepSpeedStage3Layout(Layout):
    """DeepSpeed ZeRO-3: flat fp32 master partitions, copied into each parameter's ``ds_tensor``."""

    @property
    def stateful(self) -> Optimizer:
        return self.optimizer.optimizer  # type: ignore[attr-defined,no-any-return]

    def truths(self) -> list[torch.Tensor]:
        return list(self.optimizer.fp32_partitioned_groups_flat)  # type: ignore[attr-defined]

    def before_write(self) -> None:
        # Parameters gathered by an evaluation forward are released, so that none keeps stale values.
        self.optimizer.checkpoint_event_prologue()  # type: ignore[attr-defined]

    def after_write(self) -> None:
        ds = self.optimizer
        for sub_group in range(len(ds.fp32_partitioned_groups_flat)):  # type: ignore[attr-defined]
            # What DeepSpeed's own step does after updating the master partition of a sub-group.
            ds._reassign_or_swap_out_partitioned_parameters(sub_group)  # type: ignore[attr-defined]
        # Persistent parameters (small ones ZeRO-3 keeps whole) are gathered again from their partitions.
        ds.checkpoint_event_epilogue()  # type: ignore[attr-defined]


def layout_of(optimizer: Any) -> Layout:
    """The layout of an optimizer a strategy steps; ``ValueError`` for one whose weights cannot be found."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return ZeroLayout(optimizer)
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        raise ValueError(
            "EMA cannot average weights DeepSpeed swaps to NVMe (offload_optimizer='nvme' or"
            " offload_params='nvme'): they are not in memory between steps. Use offload to 'cpu', or drop EMA."
        )
    if any(hasattr(optimizer, name) for name in _DEEPSPEED_MASTERS) and hasattr(
        optimizer, "update_lp_params"
    ):
        return DeepSpeedLayout(optimizer)
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return DeepSpeedStage3Layout(optimizer)
    if isinstance(optimizer, Optimizer):
        return Layout(optimizer)
    raise ValueError(
        f"EMA cannot find the weights {type(optimizer).__name__} steps: it averages the parameters of torch"
        " optimizers, ZeroRedundancyOptimizer and DeepSpeed's ZeRO optimizers (stages 1-3). With DeepSpeed at"
        " stage 0 use precision='32-true', or use ShardStrategy(stage=1, engine='deepspeed')."
    )
