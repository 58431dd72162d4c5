"""One rank's pipeline stage, run through a torch schedule: a training step (forward and backward per
microbatch) or a forward-only evaluation step, and the loss every stage reports.

The schedule cuts each batch into ``m`` microbatches along its first dimension and computes the loss of
each on the last stage. The full-batch loss of a mean-reduced loss is the mean of the microbatch losses,
so each microbatch's loss is scaled by ``1 / m`` (and by Lightning's ``1 / accumulate_grad_batches``)
before its backward: the gradients then sum to the full-batch ones. torch's own ``scale_grads`` divides
every ``.grad`` after the step instead, which would also divide what earlier accumulation steps left
there, so it is off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.pipeline.schedules import schedule_class

LossFn = Callable[[Any, Any], Tensor]


class StageRunner:
    """Runs ``module`` as stage ``stage`` of ``num_stages`` (one per rank of ``group``) under ``schedule``."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.stage = PipelineStage(module, stage, num_stages, device, group=group)
        self.microbatches = microbatches
        self._loss_fn = loss_fn
        self._scale = 1.0
        self.schedule = schedule_class(schedule)(
            self.stage, microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        self._forward_only: Any = None  # a schedule without a loss, for predict (made on first use)
        self._group = group
        self._device = device
        self._last_rank = dist.get_global_rank(group, num_stages - 1)

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

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
        self.schedule.step(
            *args, target=target if self.is_last else None, losses=losses, return_outputs=False
        )
        return self._broadcast_loss(losses, loss_scale)

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
        from lightning.fabric.utilities.apply_func import move_data_to_device

        check_microbatches(inputs, None, self.microbatches)
        if self._forward_only is None:
            self._forward_only = type(self.schedule)(self.stage, self.microbatches)
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


__all__ = ["StageRunner", "check_microbatches"]
