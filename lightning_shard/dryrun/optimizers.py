"""The user's optimizers over the set-up shards, and their state as one step leaves it.

The optimizers come from the module's ``configure_optimizers`` (a LightningModule's, in any of the forms
Lightning accepts: an optimizer, a list, a dict with ``"optimizer"``, a pair of lists), else AdamW over every
parameter (what a Hugging Face model trains with). The engine then takes them as a run does
(``Session.setup_optimizers``: ZeRO-1's partition, the step on local shards, whole-matrix steps), and one step
runs on zero gradients of the shards' own layout: on the meta device it allocates nothing and leaves every
state tensor the optimizer keeps, in its real shape and dtype. Where the step cannot run on meta (an optimizer
with a data-dependent step), the state is laid out from the optimizer's kind instead (:func:`states_per_element`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_shard.core.session import Session
from lightning_shard.engines import TrainSettings

log = logging.getLogger(__name__)


def user_optimizers(module: nn.Module) -> list[Optimizer]:
    """The optimizers ``module.configure_optimizers()`` returns (the schedulers left out), else AdamW."""
    configure = getattr(module, "configure_optimizers", None)
    if not callable(configure):
        return [torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])]
    found: list[Optimizer] = []

    def collect(value: Any) -> None:
        if isinstance(value, Optimizer):
            found.append(value)
        elif isinstance(value, dict):
            collect(value.get("optimizer"))
        elif isinstance(value, (list, tuple)) and value:
            if isinstance(value[0], (list, tuple)):  # ([optimizers], [schedulers])
                collect(list(value[0]))
            else:
                for item in value:
                    collect(item)

    collect(configure())
    return found


def states_per_element(optimizer: Optimizer) -> int:
    """Tensors of a parameter's shape the optimizer keeps (the layout when a step cannot run): Adam-family 2
    (3 with ``amsgrad``), SGD with momentum and the other one-buffer kinds 1, plain SGD 0."""
    name = type(optimizer).__name__.lower()
    defaults = optimizer.defaults
    if "adam" in name:
        return 3 if defaults.get("amsgrad") else 2
    if name == "sgd":
        return 1 if defaults.get("momentum") else 0
    return 1


def _lay_out_states(optimizer: Optimizer) -> None:
    inner = getattr(optimizer, "optim", optimizer)
    count = states_per_element(inner)
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param] = {f"state{i}": torch.zeros_like(param) for i in range(count)}


def step_on_shards(session: Session, optimizers: list[Optimizer]) -> tuple[list[Optimizer], str | None]:
    """The engine's optimizers after one step on zero gradients; a note when the state had to be laid out
    from the optimizer's kind."""
    optimizers = session.setup_optimizers(optimizers, [], TrainSettings())
    note = None
    for optimizer in optimizers:
        for group in getattr(optimizer, "optim", optimizer).param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        try:
            optimizer.step()
        except Exception as error:  # any failure of a step on meta: the state is laid out instead
            log.debug("dry run: %s.step() on meta failed (%s)", type(optimizer).__name__, error)
            _lay_out_states(optimizer)
            note = f"{type(optimizer).__name__}: state laid out from its kind (the step does not run on meta: {error})"
        optimizer.zero_grad(set_to_none=True)
    return optimizers, note
