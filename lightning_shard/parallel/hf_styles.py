"""Hugging Face tensor-parallel plan styles that torch's ``parallelize_module`` has no style for, written as torch
``ParallelStyle`` objects the way transformers runs them (``transformers.distributed.tensor_parallel``).

- ``"replicated_with_grad_allreduce"``: a module (Qwen3's per-head ``q_norm`` / ``k_norm``) whose parameters stay
  whole on every tensor-parallel rank while it runs on the rank's own heads, so each rank's gradient covers only
  its heads: the gradient is summed over the tensor-parallel group once it is accumulated.
- ``"moe_tp_experts"`` with its parameters' entries (``experts.gate_up_proj: "packed_colwise"``,
  ``experts.down_proj: "rowwise"``): every rank holds a slice of every expert. The 3-D weights
  ``(E, out, in)`` are split along ``out`` (colwise) or ``in`` (rowwise); a packed ``gate_up_proj`` (gate and up
  projections stacked along ``out``) keeps a slice of each half, which is torch's ``_StridedShard(out,
  split_factor=2)``: rank r holds rows ``[g_r; u_r]`` so that ``chunk(2)`` of its output gives its gate and up
  slices. The module runs on its local slices: its input's gradient is summed over the group in backward (each rank
  saw the whole input but only part of the weights), its partial outputs are summed in forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

#: How a Hugging Face plan may split one parameter of an experts module (``moe_tp_experts``).
PARAMETER_STYLES = ("packed_colwise", "colwise", "rowwise")


class _SumForward(torch.autograd.Function):
    """Sum over the group in forward; the gradient (the same on every rank) passes through."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """The identity in forward; the gradient summed over the group in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def parameter_placement(style: str, ndim: int) -> Placement:
    """The tensor-parallel placement of an experts weight ``(E, out, in)`` (or a 2-D ``(out, in)``) for ``style``."""
    out_dim = max(0, ndim - 2)
    if style == "packed_colwise":
        return _StridedShard(out_dim, split_factor=2)
    if style == "colwise":
        return Shard(out_dim)
    if style == "rowwise":
        return Shard(ndim - 1)
    raise ValueError(f"no placement for the parameter style {style!r}; use one of {PARAMETER_STYLES}.")


class ReplicatedGradAllReduce(ParallelStyle):
    """``"replicated_with_grad_allreduce"``: parameters whole, gradients summed over the group (module docstring).

    The hook goes on the parameter the forward uses, registered at the first forward that uses it: FSDP2 swaps in
    its own (gathered) parameters after the set-up, which a hook registered now would miss."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        hooked: dict[str, int] = {}

        def sum_grad(param: torch.Tensor) -> None:
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)

        def register(mod: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for name, param in mod.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) != id(param):
                    param.register_post_accumulate_grad_hook(sum_grad)
                    hooked[name] = id(param)

        module.register_forward_pre_hook(register)
        return module


class ExpertsTensorParallel(ParallelStyle):
    """``"moe_tp_experts"``: an experts module's 3-D weights split over the group (module docstring).

    ``parameters``: parameter name -> ``"packed_colwise"``, ``"colwise"`` or ``"rowwise"``; the module's first
    positional argument is its tokens' hidden states, and a third (or ``top_k_weights=``) their routing weights."""

    def __init__(self, parameters: Mapping[str, str]) -> None:
        super().__init__()
        bad = {name: style for name, style in parameters.items() if style not in PARAMETER_STYLES}
        if bad:
            raise ValueError(
                f"ExpertsTensorParallel(parameters={dict(parameters)!r}): {bad} are not parameter styles; use"
                f" {', '.join(repr(s) for s in PARAMETER_STYLES)}."
            )
        self.parameters = dict(parameters)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, style in self.parameters.items():
            param = getattr(module, name, None)
            if not isinstance(param, nn.Parameter):
                raise ValueError(
                    f"ShardStrategy(tensor_parallel_plan=...): {type(module).__name__} has no parameter {name!r}"
                    f" for the style {style!r}."
                )
            placement = parameter_placement(style, param.ndim)
            split = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        group = device_mesh.get_group()
        held: dict[str, Any] = {}
        names = tuple(self.parameters)

        def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            for name in names:  # the forward runs on this rank's slices as plain tensors
                value = mod._parameters[name]
                if isinstance(value, DTensor):
                    held[name] = value
                    mod._parameters[name] = value.to_local()  # type: ignore[assignment]
            values = list(args)
            values[0] = _sum_backward(values[0], group)
            if len(values) > 2:
                values[2] = _sum_backward(values[2], group)
            if "top_k_weights" in kwargs:
                kwargs = {**kwargs, "top_k_weights": _sum_backward(kwargs["top_k_weights"], group)}
            return tuple(values), kwargs

        def leave(mod: nn.Module, args: Any, output: Any) -> Any:
            for name, value in held.items():
                mod._parameters[name] = value
            held.clear()
            return _SumForward.apply(output, group) if isinstance(output, torch.Tensor) else output

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
        return module


def _sum_backward(value: Any, group: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    return _SumBackward.apply(value, group) if isinstance(value, torch.Tensor) else value


__all__ = ["PARAMETER_STYLES", "ExpertsTensorParallel", "ReplicatedGradAllReduce", "parameter_placement"]
