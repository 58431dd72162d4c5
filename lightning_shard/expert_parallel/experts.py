"""What an experts module holds and how its experts compute, read from the module itself.

The layout is Hugging Face transformers' (5.x) experts layout, which ``@use_experts_implementation`` decorates:
3-D parameters with the expert on dim 0,

- ``gate_up_proj`` ``[E, 2I, H]`` (gated experts; ``up_proj`` ``[E, I, H]`` when not gated),
- ``down_proj`` ``[E, H, I]``,
- optional ``gate_up_proj_bias`` / ``up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``,
- ``[E, in, out]`` instead when ``is_transposed`` (gpt-oss),

and the forward contract ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
The activation stays the model's own: ``module._apply_gate(gate_up)`` (gpt-oss's clamped, interleaved SwiGLU,
or transformers' default ``act_fn(gate) * up``), ``module.act_fn`` for ungated experts, and
``module.post_expert_norm`` where the module has one. Only the matrix products are this package's
(:func:`.grouped.grouped_linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_shard.expert_parallel.grouped import ComputeMode, grouped_linear


def _local(t: Tensor) -> Tensor:
    # The local block of a Shard(0) parameter; differentiable, its gradient lands on the DTensor's local shard.
    return t.to_local() if isinstance(t, DTensor) else t


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient multiplied by ``scale`` on its way back."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _scaled(tensor: Tensor, scale: float) -> Tensor:
    if scale == 1.0:
        return tensor
    out: Tensor = _ScaleGradient.apply(tensor, scale)
    return out


@dataclass(frozen=True)
class ExpertLayout:
    """Names and flags of one experts module's parameters (see the module docstring)."""

    up: str
    down: str
    up_bias: str | None
    down_bias: str | None
    gated: bool
    transposed: bool
    post_norm: bool

    @property
    def expert_parameters(self) -> tuple[str, ...]:
        """The parameters split by expert (dim 0)."""
        names = (self.up, self.down, self.up_bias, self.down_bias)
        return tuple(name for name in names if name is not None)

    @classmethod
    def of(cls, module: nn.Module, name: str) -> ExpertLayout:
        """The layout of ``module`` (named ``name`` in its model), or a ``ValueError`` saying what is missing."""
        kind = f"{name} ({type(module).__name__})"
        if isinstance(module, nn.ModuleList) or _holds_expert_list(module):
            raise ValueError(
                f"expert parallelism: {kind} holds its experts as an nn.ModuleList of per-expert modules. Only"
                " experts held as 3-D parameters [E, ...] with the forward (hidden_states, top_k_index,"
                " top_k_weights) are split (Hugging Face transformers >= 5 layout: gate_up_proj, down_proj): a"
                " ModuleList's routing loop lives in its parent's forward, which indexes experts by global id."
                " Hold the experts as 3-D parameters, or leave this module out of the plan."
            )
        params = dict(module.named_parameters(recurse=False))
        up = next((p for p in ("gate_up_proj", "up_proj") if p in params), None)
        if up is None or "down_proj" not in params:
            raise ValueError(
                f"expert parallelism: {kind} has no 3-D expert weights to split: it needs 'gate_up_proj' (or"
                " 'up_proj') [E, out, in] and 'down_proj' [E, out, in] parameters, expert on dim 0; it has"
                f" {sorted(params) or 'no parameters of its own'}."
            )
        gated = up == "gate_up_proj"
        if gated and not (hasattr(module, "_apply_gate") or hasattr(module, "act_fn")):
            raise ValueError(
                f"expert parallelism: {kind} holds gate_up_proj but neither '_apply_gate' nor 'act_fn': the"
                " activation between its products stays the model's own, and none was found."
            )
        if not gated and not hasattr(module, "act_fn"):
            raise ValueError(f"expert parallelism: {kind} holds up_proj but no 'act_fn' activation.")
        for p in (up, "down_proj"):
            if params[p].dim() != 3:
                raise ValueError(
                    f"expert parallelism: {name}.{p} has shape {tuple(params[p].shape)}; expert weights are 3-D"
                    " [E, out, in]."
                )
        return cls(
            up=up,
            down="down_proj",
            up_bias=f"{up}_bias" if f"{up}_bias" in params else None,
            down_bias="down_proj_bias" if "down_proj_bias" in params else None,
            gated=gated,
            transposed=bool(getattr(module, "is_transposed", False)),
            post_norm=bool(getattr(module, "has_post_expert_norm", False)),
        )

    def num_experts(self, module: nn.Module, name: str) -> int:
        """E, checked to agree across the expert parameters (and the module's ``num_experts``, if any)."""
        sizes = {p: getattr(module, p).shape[0] for p in self.expert_parameters}
        own = getattr(module, "num_experts", None)
        if isinstance(own, int):
            sizes["num_experts"] = own
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"expert parallelism: {name} ({type(module).__name__}) disagrees on its expert count: {sizes}."
            )
        return next(iter(sizes.values()))

    def compute(
        self,
        module: nn.Module,
        rows: Tensor,
        counts: list[int],
        mode: ComputeMode,
        gradient_scale: float = 1.0,
    ) -> Tensor:
        """The local experts on ``rows`` ``[R, H]`` grouped by expert: ``[R, H]``, before routing weights; the
        weights' gradients multiplied by ``gradient_scale``."""

        def param(name: str | None) -> Tensor | None:
            return None if name is None else _scaled(_local(getattr(module, name)), gradient_scale)

        up, down = param(self.up), param(self.down)
        assert up is not None and down is not None
        hidden = grouped_linear(
            rows, up, counts, param(self.up_bias), self.transposed, mode
        )  # [R, 2I] / [R, I]
        if not self.gated:
            hidden = _own(module, "act_fn")(hidden)
        elif hasattr(module, "_apply_gate"):
            hidden = _own(module, "_apply_gate")(hidden)  # [R, I]
        else:
            gate, linear = hidden.chunk(2, dim=-1)
            hidden = _own(module, "act_fn")(gate) * linear  # [R, I]
        out = grouped_linear(hidden, down, counts, param(self.down_bias), self.transposed, mode)  # [R, H]
        if self.post_norm:
            out = _own(module, "post_expert_norm")(out)
        return out


def _own(module: nn.Module, attr: str) -> Callable[[Tensor], Tensor]:
    """The model's own function (activation, gate, norm) the experts module holds as ``attr``."""
    fn: Callable[[Tensor], Tensor] = getattr(module, attr)
    return fn


def _holds_expert_list(module: nn.Module) -> bool:
    """A module whose experts are an ``nn.ModuleList`` child (transformers 4's Mixtral block, for one)."""
    return any(isinstance(child, nn.ModuleList) for child in module.children()) and not any(
        p.dim() == 3 for p in module.parameters(recurse=False)
    )
