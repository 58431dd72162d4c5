"""Stage 1: the user's optimizer behind ``ZeroRedundancyOptimizer``, with name-keyed, reshardable state.

``ZeroRedundancyOptimizer`` gives each rank the optimizer state of its own partition of the
parameters. Its ``state_dict`` can only be consolidated on one rank, which neither scales nor
reshards; here each rank contributes the entries of the parameters it owns, keyed by parameter
name, in the same layout ``get_optimizer_state_dict`` uses at stages 2-3. So one checkpoint format
serves every stage and any world size: a rank loads whichever entries its new partition owns.

Under expert parallelism each rank holds ``E/ep`` whole experts of every experts module, a block other ranks
do not hold; ZeroRedundancyOptimizer's step would end with a block's owner broadcasting it over every rank's.
Here, as DeepSpeed's MoE ZeRO-1 does, the rest is partitioned over the whole group as before and each expert
block over the ranks that hold the same block (the expert data-parallel group): its owner there steps it and
broadcasts it to that group only (:class:`ExpertBlocks`). An expert block's state is saved as a DTensor placed
``Shard(0)`` on the expert-parallel mesh, as the parameter is: each block once, by its owner, in the layout
stages 0, 2 and 3 save, so a checkpoint reshards between stages and expert-parallel sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_shard._modules import SPLIT_OVER, TIED_COPY
from lightning_shard._optim import constructor_defaults
from lightning_shard.engines import _named_state as named_state
from lightning_shard.engines._shm import shared_memory_group
from lightning_shard.parallel.clip import shard_count

_NAMED: dict[type, type[ZeroRedundancyOptimizer]] = {}


class _StandIn(nn.Parameter):
    """A plain parameter that ZeroRedundancyOptimizer can broadcast and step, standing in for a DTensor one.

    Its ``grad`` is read from the DTensor parameter's gradient at every access (that gradient's local
    tensor, shared, not copied), so every reader sees the gradient of the moment: the optimizer's step,
    gradient clipping, the loss scaler, the non-finite check, callbacks. A copy taken at one point went
    stale whenever the parameter's gradient was replaced later (a backward into a zeroed gradient, a
    pipeline schedule's gradients added at Lightning's backward), and the step then used the previous
    batch's gradient or none at all.
    """

    target: DTensor

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        grad = self.target.grad
        return None if grad is None else grad.to_local()  # type: ignore[attr-defined]

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        target = self.target
        target.grad = (
            None
            if value is None
            else DTensor.from_local(
                value, target.device_mesh, target.placements, shape=target.shape, stride=target.stride()
            )
        )


def _stand_in(param: DTensor) -> _StandIn:
    stand_in = _StandIn(param.to_local().detach(), requires_grad=param.requires_grad)
    stand_in.target = param
    if getattr(param, TIED_COPY, False):  # the clip norm counts a tied parameter's first copy only
        setattr(stand_in, TIED_COPY, True)
    # The clip norm counts each element once: an expert block is one of ep different blocks, not a copy.
    setattr(stand_in, SPLIT_OVER, shard_count(param))
    return stand_in


@dataclass(frozen=True)
class ExpertBlocks:
    """Expert parallelism at stage 1: the parameters that are this rank's expert blocks, and who holds them."""

    params: frozenset[nn.Parameter]
    """The experts modules' parameters (DTensors), replicated over ``data_group`` rather than the whole group."""
    ep_mesh: Any
    """The 1-D expert-parallel mesh the blocks are placed ``Shard(0)`` on (their saved layout)."""
    data_group: Any
    """The ranks that hold this rank's blocks: each block's optimizer state is partitioned over them."""


@dataclass(frozen=True)
class _Experts:
    """:class:`ExpertBlocks` in the optimizer's terms: stand-ins, and the data group's ranks in its group."""

    stand_ins: frozenset[nn.Parameter]
    members: list[int]
    group: Any
    ep_mesh: Any

    def holds(self, param: torch.Tensor) -> bool:
        return param in self.stand_ins


class _ZeroOptimizer(ZeroRedundancyOptimizer):
    #: ``(stand-in, DTensor parameter)`` pairs where the parameters are DTensors (see :func:`shard_optimizer`).
    _stand_ins: list[tuple[nn.Parameter, DTensor]] = []
    _experts: _Experts | None = None
    # torch's, absent from its type stub: the param groups of each rank's partition
    _partition_parameters_cache: list[list[dict[str, Any]]]

    def __init__(self, params: Any, *, experts: _Experts | None = None, **kwargs: Any) -> None:
        self._experts = experts  # read by the partition, which torch's constructor computes
        super().__init__(params, **kwargs)

    def attach_params(self) -> None:
        """Point each stand-in at its DTensor parameter's local tensor (shared, not copied), which FSDP2 may
        have moved since set-up: what the step updates and broadcasts is the parameter's."""
        for stand_in, param in self._stand_ins:
            stand_in.data = param.to_local().detach()

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        self.attach_params()
        return super().step(closure, **kwargs)

    def _partition_parameters(
        self, params_per_rank: list[list[torch.Tensor]] | None = None
    ) -> list[list[dict[str, Any]]]:
        """Torch's partition (largest parameter first, to the least-loaded rank), with expert blocks to the ranks
        that hold them. Two independent passes: the rest's owners are then the same on every rank, and a block's
        owner sits at the same place in every data group, so that the owners of one parameter's blocks are one
        expert-parallel group (a full checkpoint gathers them there)."""
        experts = self._experts
        if experts is None or params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)  # type: ignore[misc]
        owner: dict[torch.Tensor, int] = {}
        for members, expert in ((list(range(self.world_size)), False), (experts.members, True)):
            sizes = dict.fromkeys(members, 0)
            for group in self.param_groups:
                params = [p for p in group["params"] if experts.holds(p) == expert]
                for p in sorted(params, key=lambda t: t.numel(), reverse=True):
                    owner[p] = rank = min(members, key=sizes.__getitem__)
                    sizes[rank] += p.numel()
        self._partition_parameters_cache = [
            [
                {**group, "params": [p for p in group["params"] if owner[p] == r]}
                for group in self.param_groups
            ]
            for r in range(self.world_size)
        ]
        return self._partition_parameters_cache

    def _sync_params(self) -> None:
        """After a step each rank sends its updated partition to the others (torch: one broadcast per rank's
        bucket); among CPU ranks on one host through shared memory (``engines/_shm.py``). An expert block goes
        to the ranks of its data group only: the others hold other blocks."""
        if self._experts is not None:
            self._sync_with_experts(self._experts)
            return
        buckets: list[list[torch.Tensor]] = (
            getattr(self, "_buckets", []) if self.parameters_as_bucket_view else []
        )
        shm = shared_memory_group(self.process_group) if buckets else None
        if shm is not None and all(shm.gather(list(per_rank), per_rank[self.rank]) for per_rank in buckets):
            return
        super()._sync_params()  # type: ignore[misc]

    def _sync_with_experts(self, experts: _Experts) -> None:
        handles = []
        # The rest first, over the whole group (the same broadcasts on every rank), then the blocks over each
        # data group (the same broadcasts on every rank of it).
        for expert, group in ((False, self.process_group), (True, experts.group)):
            if expert and len(experts.members) == 1:
                continue
            for rank, rank_groups in enumerate(self._partition_parameters()):
                src = dist.get_global_rank(self.process_group, rank)
                for param_group in rank_groups:
                    for p in param_group["params"]:
                        if experts.holds(p) == expert:
                            handles.append(dist.broadcast(p.data, src=src, group=group, async_op=True))
        for handle in handles:
            handle.wait()


def named_zero_class(optimizer_class: type) -> type[ZeroRedundancyOptimizer]:
    """``ZeroRedundancyOptimizer`` under the name of the class it shards (a subclass adding nothing).

    Lightning's ``LearningRateMonitor`` keys its metrics by ``type(optimizer).__name__`` (``lr-SGD``, and
    ``lr-SGD-1`` for a second one): with this name the keys at stage 1 are DDP's."""
    if optimizer_class not in _NAMED:
        _NAMED[optimizer_class] = type(
            optimizer_class.__name__,
            (_ZeroOptimizer,),
            {
                "__module__": __name__,
                "__qualname__": f"ZeroRedundancyOptimizer[{optimizer_class.__qualname__}]",
                "__doc__": f"ZeroRedundancyOptimizer sharding {optimizer_class.__qualname__}.",
            },
        )
    return _NAMED[optimizer_class]


def shard_optimizer(
    optimizer: Optimizer, process_group: Any, experts: ExpertBlocks | None = None
) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer of the same class, hyperparameters and param groups as ``optimizer``.

    DTensor parameters (replicated over ``process_group`` by FSDP2's ``replicate()``: pipeline stages,
    expert parallelism), which ZeroRedundancyOptimizer cannot broadcast, are each given to it as a plain
    stand-in that shares the parameter's local tensor and gradient (:class:`_StandIn`). ``experts``: the
    expert blocks, partitioned over their data group (module docstring).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    groups = [dict(group) for group in optimizer.param_groups]
    stand_ins: list[tuple[nn.Parameter, DTensor]] = []
    for group in groups:
        params = []
        for p in group["params"]:
            if isinstance(p, DTensor):
                stand_in = _stand_in(p)
                stand_ins.append((stand_in, p))
                p = stand_in
            params.append(p)
        group["params"] = params
    zero = named_zero_class(type(optimizer))(
        groups,
        experts=None if experts is None else _expert_stand_ins(experts, stand_ins, process_group),
        optimizer_class=type(optimizer),
        process_group=process_group,
        # After each step every rank sends its updated parameters to the others: from one flat bucket
        # per rank instead of one broadcast per parameter (the profile of a 6-block GPT on gloo: 77
        # broadcasts and their waits, a quarter of the step, became 2). Stand-ins keep their own storage
        # (a bucket would move them off the parameters' tensors): one broadcast per parameter.
        parameters_as_bucket_view=not stand_ins,
        **constructor_defaults(optimizer),
    )
    zero._stand_ins = stand_ins  # type: ignore[attr-defined]
    return zero


def _expert_stand_ins(
    experts: ExpertBlocks, stand_ins: list[tuple[nn.Parameter, DTensor]], process_group: Any
) -> _Experts:
    members = [
        dist.get_group_rank(process_group, r) for r in dist.get_process_group_ranks(experts.data_group)
    ]
    return _Experts(
        frozenset(stand_in for stand_in, p in stand_ins if p in experts.params),
        sorted(members),
        experts.data_group,
        experts.ep_mesh,
    )


def _param_names(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[nn.Parameter, str]:
    inner = getattr(model, "module", model)
    names = {p: name for name, p in inner.named_parameters()}
    names.update({stand_in: names[p] for stand_in, p in getattr(zero, "_stand_ins", ())})
    return names


def _global_groups(zero: ZeroRedundancyOptimizer, names: dict[nn.Parameter, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in zero.param_groups
    ]


def _local_params(zero: ZeroRedundancyOptimizer) -> list[nn.Parameter]:
    return [p for group in zero.optim.param_groups for p in group["params"]]


def optimizer_state_dict(model: nn.Module, zero: Optimizer, full: bool) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [...]}``: this rank's entries, or every rank's if ``full``."""
    assert isinstance(zero, ZeroRedundancyOptimizer)
    names = _param_names(model, zero)
    state = {
        names[p]: {k: _saved(zero, p, v, full) for k, v in zero.optim.state[p].items()}
        for p in _local_params(zero)
        if p in zero.optim.state
    }
    if full:
        state = named_state.on_every_rank(state)
    return {"state": state, "param_groups": _global_groups(zero, names)}


def load_target(model: nn.Module, zero: Optimizer, meta: Any, key: str) -> dict[str, Any]:
    """Empty tensors, shaped from the checkpoint's metadata, for the entries this rank owns."""
    assert isinstance(zero, ZeroRedundancyOptimizer)
    names = _param_names(model, zero)
    state = {
        names[p]: named_state.saved_fields(meta, key, names[p], functools.partial(_empty, zero, p))
        for p in _local_params(zero)
    }
    return {"state": state, "param_groups": _global_groups(zero, names)}


def load_optimizer_state_dict(model: nn.Module, zero: Optimizer, state_dict: dict[str, Any]) -> None:
    """Install the entries this rank owns and every group's hyperparameters (from any stage's checkpoint)."""
    assert isinstance(zero, ZeroRedundancyOptimizer)
    names = _param_names(model, zero)
    saved = state_dict["state"]
    for p in _local_params(zero):
        entry = saved.get(names[p])
        if entry is None:
            continue
        zero.optim.state[p] = {k: _to_param_device(_loaded(zero, p, v), p) for k, v in entry.items()}
    named_state.load_hyperparameters(zero.param_groups, state_dict["param_groups"])


def _to_param_device(value: Any, param: nn.Parameter) -> Any:
    # Moments follow their parameter; scalar entries (Adam's ``step``) stay where torch keeps them (CPU).
    if not torch.is_tensor(value):
        return value
    return value.to(param.device) if value.dim() > 0 else value.clone()


# --- expert blocks' state: DTensors on the expert-parallel mesh, as the parameters ---------------------------


def _block_experts(zero: ZeroRedundancyOptimizer, param: nn.Parameter, shape: Any) -> _Experts | None:
    """The expert set-up where a state of ``shape`` is per element of an expert block (``exp_avg``, not
    ``step``): shaped as the block, or as the whole ``[E, ...]`` parameter (a full checkpoint's)."""
    experts = getattr(zero, "_experts", None)
    if experts is None or not isinstance(param, _StandIn) or not experts.holds(param) or len(shape) == 0:
        return None
    return experts if tuple(shape) in (tuple(param.shape), tuple(param.target.shape)) else None


def _saved(zero: ZeroRedundancyOptimizer, param: nn.Parameter, value: Any, full: bool) -> Any:
    if not torch.is_tensor(value):
        return value
    experts = _block_experts(zero, param, value.shape)
    if experts is not None:
        block = DTensor.from_local(value, experts.ep_mesh, [Shard(0)], run_check=False)
        # A full checkpoint: the owners of this parameter's blocks are one expert-parallel group.
        return block.full_tensor().cpu() if full else block
    return value.detach().cpu() if full else value


def _empty(zero: ZeroRedundancyOptimizer, param: nn.Parameter, md: Any) -> Any:
    if not isinstance(md, TensorStorageMetadata):
        return None
    experts = _block_experts(zero, param, md.size)
    if experts is None or tuple(md.size) == tuple(param.shape):
        return torch.empty(md.size, dtype=md.properties.dtype)
    # This rank's block only: DCP reads it from wherever the checkpoint's stage put it.
    block = torch.empty(param.shape, dtype=md.properties.dtype)
    return DTensor.from_local(block, experts.ep_mesh, [Shard(0)], run_check=False)


def _loaded(zero: ZeroRedundancyOptimizer, param: nn.Parameter, value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if not torch.is_tensor(value):
        return value
    experts = _block_experts(zero, param, value.shape)
    if experts is None or value.shape == param.shape:
        return value
    rows = param.shape[0]  # a full checkpoint's whole [E, ...]: this rank's E/ep rows
    return value.narrow(0, experts.ep_mesh.get_local_rank() * rows, rows).clone()
