"""Stage 1: the user's optimizer behind ``ZeroRedundancyOptimizer``, with name-keyed, reshardable state.

``ZeroRedundancyOptimizer`` gives each rank the optimizer state of its own partition of the
parameters. Its ``state_dict`` can only be consolidated on one rank, which neither scales nor
reshards; here each rank contributes the entries of the parameters it owns, keyed by parameter
name, in the same layout ``get_optimizer_state_dict`` uses at stages 2-3. So one checkpoint format
serves every stage and any world size: a rank loads whichever entries its new partition owns.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_shard._modules import TIED_COPY
from lightning_shard.engines._shm import shared_memory_group

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
    return stand_in


class _ZeroOptimizer(ZeroRedundancyOptimizer):
    #: ``(stand-in, DTensor parameter)`` pairs where the parameters are DTensors (see :func:`shard_optimizer`).
    _stand_ins: list[tuple[nn.Parameter, DTensor]] = []

    def attach_params(self) -> None:
        """Point each stand-in at its DTensor parameter's local tensor (shared, not copied), which FSDP2 may
        have moved since set-up: what the step updates and broadcasts is the parameter's."""
        for stand_in, param in self._stand_ins:
            stand_in.data = param.to_local().detach()

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        self.attach_params()
        return super().step(closure, **kwargs)

    def _sync_params(self) -> None:
        """After a step each rank sends its updated partition to the others (torch: one broadcast per rank's
        bucket); among CPU ranks on one host through shared memory (``engines/_shm.py``)."""
        buckets: list[list[torch.Tensor]] = (
            getattr(self, "_buckets", []) if self.parameters_as_bucket_view else []
        )
        shm = shared_memory_group(self.process_group) if buckets else None
        if shm is not None and all(shm.gather(list(per_rank), per_rank[self.rank]) for per_rank in buckets):
            return
        super()._sync_params()  # type: ignore[misc]


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


def shard_optimizer(optimizer: Optimizer, process_group: Any) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer of the same class, hyperparameters and param groups as ``optimizer``.

    DTensor parameters (replicated over ``process_group`` by FSDP2's ``replicate()``: pipeline stages,
    tensor parallelism), which ZeroRedundancyOptimizer cannot broadcast, are each given to it as a plain
    stand-in that shares the parameter's local tensor and gradient (:class:`_StandIn`).
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
        optimizer_class=type(optimizer),
        process_group=process_group,
        # After each step every rank sends its updated parameters to the others: from one flat bucket
        # per rank instead of one broadcast per parameter (the profile of a 6-block GPT on gloo: 77
        # broadcasts and their waits, a quarter of the step, became 2). Stand-ins keep their own storage
        # (a bucket would move them off the parameters' tensors): one broadcast per parameter.
        parameters_as_bucket_view=not stand_ins,
        **_constructor_defaults(optimizer),
    )
    zero._stand_ins = stand_ins  # type: ignore[attr-defined]
    return zero


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    # Some optimizers record defaults their constructor does not take (AdamW's
    # decoupled_weight_decay); every group carries them anyway, so pass only what the constructor accepts.
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


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
        names[p]: {
            k: (v.detach().cpu() if full and torch.is_tensor(v) else v)
            for k, v in zero.optim.state[p].items()
        }
        for p in _local_params(zero)
        if p in zero.optim.state
    }
    if full and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        state = {name: entry for part in gathered for name, entry in part.items()}
    return {"state": state, "param_groups": _global_groups(zero, names)}


def load_target(model: nn.Module, zero: Optimizer, meta: Any, key: str) -> dict[str, Any]:
    """Empty tensors, shaped from the checkpoint's metadata, for the entries this rank owns."""
    assert isinstance(zero, ZeroRedundancyOptimizer)
    names = _param_names(model, zero)
    entries = meta.state_dict_metadata
    state: dict[str, dict[str, Any]] = {}
    for p in _local_params(zero):
        prefix = f"{key}.state.{names[p]}."
        fields = {
            k[len(prefix) :]: md
            for k, md in entries.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        state[names[p]] = {
            name: torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
            for name, md in fields.items()
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
        zero.optim.state[p] = {k: _to_param_device(v, p) for k, v in entry.items()}
    groups = state_dict["param_groups"]
    if len(groups) != len(zero.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} param groups but configure_optimizers() made"
            f" {len(zero.param_groups)}. Resume with the same optimizer set-up."
        )
    for live, loaded in zip(zero.param_groups, groups, strict=True):
        live.update({k: v for k, v in loaded.items() if k != "params"})


def _to_param_device(value: Any, param: nn.Parameter) -> Any:
    # Moments follow their parameter; scalar entries (Adam's ``step``) stay where torch keeps them (CPU).
    if not torch.is_tensor(value):
        return value
    return value.to(param.device) if value.dim() > 0 else value.clone()
