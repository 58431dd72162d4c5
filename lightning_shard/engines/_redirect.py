"""Running a module's step method inside its wrapper's forward, on torch alone.

DDP and FSDP2 act in the wrapper's (or the root module's) forward: DDP arms its reducer, FSDP2 gathers the
root's parameters. A door's ``training_step`` & co. must therefore run *inside* that forward: the module's
``forward`` is swapped, for one call, for the step method, and the wrapper is called. Lightning's Trainer does
the same with its private ``_ForwardRedirection``; written here so the engines need no Trainer code.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class ForwardRedirection:
    """``redirect(wrapper, module, "training_step", *args)``: ``module.training_step(*args)`` run as the
    forward of ``wrapper`` (which wraps ``module``), so the wrapper's forward hooks act around it."""

    def __call__(
        self, wrapper: nn.Module, module: nn.Module, method_name: str, *args: Any, **kwargs: Any
    ) -> Any:
        if method_name == "forward":
            raise ValueError(
                "ForwardRedirection routes methods other than forward through the wrapper's forward."
            )
        forward = module.forward

        def step_as_forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
            module.forward = forward  # type: ignore[method-assign]  # the step may call the real forward
            out = getattr(module, method_name)(*inner_args, **inner_kwargs)
            self.on_after_inner_forward(wrapper, module)
            return out

        module.forward = step_as_forward  # type: ignore[method-assign]
        output = wrapper(*args, **kwargs)
        self.on_after_outer_forward(wrapper, module)
        return output

    def on_after_inner_forward(self, wrapper: nn.Module, module: nn.Module) -> None:
        """After the step ran, inside the wrapper's forward."""

    def on_after_outer_forward(self, wrapper: nn.Module, module: nn.Module) -> None:
        """After the wrapper's forward returned."""


class DDPForwardRedirection(ForwardRedirection):
    """With manual optimization the backward runs inside the step, before DDP's forward returns: DDP's reducer
    must not be armed a second time after it (its gradient sync is off until the forward returns)."""

    def on_after_inner_forward(self, wrapper: nn.Module, module: nn.Module) -> None:
        if isinstance(wrapper, DistributedDataParallel) and not getattr(
            module, "automatic_optimization", True
        ):
            wrapper.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper: nn.Module, module: nn.Module) -> None:
        if isinstance(wrapper, DistributedDataParallel) and not getattr(
            module, "automatic_optimization", True
        ):
            wrapper.require_backward_grad_sync = True


def prepare_for_backward(model: DistributedDataParallel, output: Any) -> None:
    """Arm DDP's reducer for a backward that starts outside its forward (a manual backward): what DDP's own
    forward does at its end, with the step's output as the forward's (torch's ``DistributedDataParallel``)."""
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        # Unused parameters are found from the tensors of the output, as DDP's forward finds them.
        tensors: list[torch.Tensor] = []
        if model.find_unused_parameters and not model.static_graph:
            apply_to_collection(output, torch.Tensor, tensors.append)
        reducer = model.reducer
        reducer._rebuild_buckets()  # DDP's forward rebuilds first; skipping it trips an internal assert
        reducer.prepare_for_backward(tensors)
    else:
        model.require_forward_param_sync = False
