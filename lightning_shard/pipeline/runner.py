"""One rank's pipeline stage, run through a torch schedule: a training step (forward and backward per
microbatch) or a forward-only evaluation step, and the loss every stage reports.

The schedule cuts each batch into ``m`` microbatches along its first dimension and computes the loss of
each on the last stage. The full-batch loss of a mean-reduced loss is the mean of the microbatch losses,
so each microbatch's loss is scaled by ``1 / m`` (and by Lightning's ``1 / accumulate_grad_batches``)
before its backward: the gradients then sum to the full-batch ones. torch's own ``scale_grads`` divides
every ``.grad`` after the step instead, which would also divide what earlier accumulation steps left
there, so it is off.

A rank that runs several stages (the interleaved schedules) holds them all in one module, cut to their
blocks (:func:`lightning_shard.pipeline.split.keep_stage`) and sharded once; each stage is a
:class:`StageView` of it that runs the module's forward with only that stage's blocks in place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from lightning_shard._modules import TIED_COPY
from lightning_shard.pipeline.schedules import SPLIT_BACKWARD_SCHEDULES, schedule_class
from lightning_shard.pipeline.split import StagePlan, set_placeholder

LossFn = Callable[[Any, Any], Tensor]


class StageView(nn.Module):
    """Stage ``stage`` of a rank that runs several: ``root``'s forward (its hooks too: FSDP2's root
    unshards the embeddings and the head) with only this stage's blocks in the block list and the other
    stages' end modules replaced. Its parameters are this stage's only (the schedule's weight-gradient
    step of zero bubble differentiates them)."""

    def __init__(self, root: nn.Module, plan: StagePlan, stage: int) -> None:
        super().__init__()
        self._root = [root]  # not registered: the rank's module is shared by its views
        self._plan = plan
        container = root.get_submodule(plan.container)
        self._blocks: OrderedDict[str, nn.Module] = OrderedDict(
            (str(i), container.get_submodule(str(i))) for i in plan.blocks_of(stage)
        )
        own = (plan.before if stage == 0 else ()) + (plan.after if stage == plan.num_stages - 1 else ())
        held = [name for name in plan.before + plan.after if _held(root, name)]
        self._absent = [name for name in held if name not in own]
        self.parts = nn.ModuleList([*self._blocks.values(), *(root.get_submodule(name) for name in own)])

    def forward(self, *args: Any) -> Any:
        with self._only_this_stage():
            return self._root[0](*args)

    @contextmanager
    def _only_this_stage(self) -> Iterator[None]:
        root = self._root[0]
        container = root.get_submodule(self._plan.container)
        blocks = container._modules
        absent = {name: set_placeholder(root, self._plan, name) for name in self._absent}
        object.__setattr__(container, "_modules", OrderedDict(self._blocks))
        try:
            yield
        finally:
            object.__setattr__(container, "_modules", blocks)
            for name, module in absent.items():
                parent, _, attr = name.rpartition(".")
                setattr(root.get_submodule(parent), attr, module)


def _held(root: nn.Module, name: str) -> bool:
    parent, _, attr = name.rpartition(".")
    module = root.get_submodule(parent)._modules.get(attr)
    return module is not None and any(True for _ in module.parameters())


class StageRunner:
    """Runs ``module`` as ``stages`` of ``num_stages`` (``stages[k]`` on rank ``stages[k] % size`` of
    ``group``) under ``schedule``; several stages need the ``plan`` that cut the module."""

    def __init__(
        self,
        module: nn.Module,
        stages: tuple[int, ...],
        num_stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
        plan: StagePlan | None = None,
        ties: tuple[Tie, ...] = (),
    ) -> None:
        if len(stages) == 1:
            self.stages = [_Stage(module, stages[0], num_stages, device, group=group)]
            target: Any = self.stages[0]
        else:
            assert plan is not None
            self.stages = [
                _Stage(StageView(module, plan, s), s, num_stages, device, group=group) for s in stages
            ]
            target = self.stages
        self.microbatches = microbatches
        self._loss_fn = loss_fn
        self._scale = 1.0
        self._target = target
        self.schedule = schedule_class(schedule)(
            target, microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        self._splits_backward = schedule in SPLIT_BACKWARD_SCHEDULES
        self._module = module
        self._forward_only: Any = None  # a schedule without a loss, for predict (made on first use)
        self._group = group
        self._device = device
        self._last_rank = dist.get_global_rank(group, (num_stages - 1) % dist.get_world_size(group))
        self._ties = ties
        for tie in ties:
            if not tie.first:  # the first stage's copy counts in the global gradient norm, the others not
                setattr(module.get_parameter(tie.name), TIED_COPY, True)

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def _scaled_loss(self, output: Any, target: Any) -> Tensor:
        return self._loss_fn(output, target) * self._scale

    def train_step(self, inputs: tuple[Any, ...], target: Any, loss_scale: float = 1.0) -> Tensor:
        """Forward and backward of one batch; returns its loss (the mean over microbatches) on every stage.

        Gradients accumulate into ``.grad`` as ``loss_scale x`` those of the full batch's loss.
        """
        check_microbatches(inputs, target, self.microbatches)
        losses: list[Tensor] = []
        self._scale = loss_scale / self.microbatches
        args = inputs if self.is_first else ()
        tied = [self._module.get_parameter(tie.name) for tie in self._ties]
        held = [p.grad for p in tied]  # what earlier batches left (accumulation) is summed once, already
        for p in tied:
            p.grad = None
        with _weight_gradients_deferred(self._module) if self._splits_backward else nullcontext():
            self.schedule.step(
                *args, target=target if self.is_last else None, losses=losses, return_outputs=False
            )
        for tie, p, grad in zip(self._ties, tied, held, strict=True):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=tie.group)  # the copies' gradients, summed
            if grad is not None:
                p.grad.add_(grad)
        return self._broadcast_loss(losses, loss_scale)

    def sync_tied(self) -> None:
        """Every copy of a tied parameter takes the first stage's values (after initialisation, which may
        have drawn each stage's copy from its own random stream)."""
        with torch.no_grad():
            for tie in self._ties:
                dist.broadcast(_local(self._module.get_parameter(tie.name)), src=tie.src, group=tie.group)

    def eval_step(self, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Forward only; returns the batch's loss (the mean over microbatches) on every stage."""
        check_microbatches(inputs, target, self.microbatches)
        losses: list[Tensor] = []
        self._scale = 1.0 / self.microbatches
        args = inputs if self.is_first else ()
        self.schedule.eval(*args, target=target if self.is_last else None, losses=losses)
        return self._broadcast_loss(losses, 1.0)

    def predict_step(self, inputs: tuple[Any, ...]) -> Any:
        """Forward only, without a loss; returns the last stage's output (on the CPU) on every stage."""
        check_microbatches(inputs, None, self.microbatches)
        if self._forward_only is None:
            self._forward_only = type(self.schedule)(self._target, self.microbatches)
        output = self._forward_only.step(*(inputs if self.is_first else ()))
        # Shapes and types are known only on the last stage: the output travels pickled, through host memory.
        box = [move_data_to_device(output, "cpu") if self.is_last else None]
        dist.broadcast_object_list(box, src=self._last_rank, group=self._group)
        return box[0]

    def _broadcast_loss(self, losses: list[Tensor], loss_scale: float) -> Tensor:
        if self.is_last:
            loss = torch.stack([loss.detach().float() for loss in losses]).sum() / loss_scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        loss = loss.to(self._device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss


@dataclass(frozen=True)
class Tie:
    """This rank's copy of a parameter that several stages use (:attr:`StagePlan.tied`)."""

    name: str
    """The parameter's name on this rank's module."""
    group: Any
    """The ranks holding a copy, at this rank's place on the other mesh dimensions."""
    src: int
    """The global rank holding the first stage's copy."""
    first: bool
    """Whether this rank holds the first stage's copy."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Stage(PipelineStage):
    """torch's stage, whose first step's shape inference (a forward and backward of one microbatch of
    placeholder tensors) runs outside any dispatch mode: a FLOP counter over that step (MFUMonitor's)
    counts the model's work only."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return super()._prepare_backward_infra(*args, **kwargs)


@contextmanager
def _weight_gradients_deferred(module: nn.Module) -> Iterator[None]:
    """FSDP2 around a schedule that computes a stage's weight gradients after its input gradients (zero
    bubble): the gathered parameters stay gathered, and the gradients unreduced, until every microbatch's
    weight gradients are in; then FSDP's post-backward runs once per parameter group, as it does after an
    ordinary backward. (torch's stage does the same only for a stage module that is itself sharded; a
    rank's stages here are views of one sharded module.)"""
    from torch.distributed._composable.replicate_with_fsdp import (  # private torch path: a release without it fails only this path
        ReplicateModule,
        replicate,
    )

    if not isinstance(module, FSDPModule):
        yield
        return
    replicated = isinstance(module, ReplicateModule)
    state = (replicate if replicated else fully_shard).state(module)  # type: ignore[attr-defined,union-attr]
    state._lazy_init()  # the shared context lists every sharded module once the root is set up
    groups = [group for sub in state._state_ctx.all_states for group in sub._fsdp_param_groups]
    saved = [
        (
            group.reduce_grads,
            group.all_reduce_grads,
            group.reshard_after_backward,
            group.post_forward_mesh_info,
        )
        for group in groups
    ]
    module.set_is_last_backward(False)
    if not replicated:  # replicate() gathers nothing
        module.set_reshard_after_forward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for group, (reduce, all_reduce, reshard, post_forward) in zip(groups, saved, strict=True):
            group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
            group.reshard_after_backward, group.post_forward_mesh_info = reshard, post_forward
        module.set_is_last_backward(True)
        for group in groups:
            group.post_backward()
        state._root_post_backward_final_callback()


def check_microbatches(inputs: tuple[Any, ...], target: Any, microbatches: int) -> None:
    """The batch's first dimension must split into ``microbatches`` equal pieces."""
    first = next((t for t in (*inputs, target) if isinstance(t, Tensor)), None)
    if first is None:
        raise ValueError(
            "ShardStrategy(pipeline_parallel_size>1) found no tensor in the batch to cut into microbatches."
            " The inputs and target must be tensors whose first dimension is the batch."
        )
    size = first.size(0)
    if size % microbatches:
        raise ValueError(
            f"ShardStrategy(microbatches={microbatches}) does not divide the batch of {size} samples"
            " this rank received: unequal microbatches would weigh samples unequally in the loss. Use a"
            " batch size per data-parallel rank that microbatches divides, or change microbatches."
        )


__all__ = ["StageRunner", "StageView", "Tie", "check_microbatches"]
