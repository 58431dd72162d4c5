"""One run as both doors hold it: the engine, the stage runner, context parallelism and the per-step logic.

:func:`~lightning_shard.core.transform.prepare` returns a :class:`Session`; the Trainer door (``ShardStrategy``)
and the Fabric door (``ShardFabricStrategy``) keep it and forward their framework's hooks to it. What a step does
with pipeline stages (the loss scale, the batch cut over the context-parallel group and its loss weight, the
schedule under the precision's forward context) and the checkpoints stages refuse are written here once; each
door keeps only what its framework alone has (Lightning's hooks and logging, Fabric's explicit calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shard.checkpoint.layout import is_deepspeed_checkpoint
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.context_parallel.batch import cut_pair
from lightning_shard.engines import Engine
from lightning_shard.pipeline import StageRunner
from lightning_shard.precision import PrecisionPolicy

#: ``run(inputs, target, scale) -> loss``: the schedule's training step (a door may hold gradients aside).
ScheduleStep = Callable[[tuple[Any, ...], Any, float], Tensor]


@dataclass
class Session:
    """What :func:`~lightning_shard.core.transform.prepare` hands back to the door, and the steps over it."""

    model: nn.Module
    """What runs: the engine's wrapper (DDP, DeepSpeed) or the module itself, sharded in place."""
    engine: Engine
    config: ShardConfig
    """The flags as resolved on the module (the block classes detected for a pipeline cut)."""
    pipeline: StageRunner | None
    """This rank's pipeline stages and their schedule (``None`` without pipeline stages)."""
    precision: PrecisionPolicy
    context_parallel: ContextParallel | None
    """This rank's context-parallel group (``None``: ``context_parallel_size=1``)."""
    device: torch.device

    def pipeline_train_step(
        self, inputs: tuple[Any, ...], target: Any, scale: float, run: ScheduleStep | None = None
    ) -> Tensor:
        """Forward and backward of one batch through this rank's stages; this rank's loss, weighted by its share
        of the targets under context parallelism (the group's mean of it is the whole sequences' loss).

        ``scale`` multiplies the gradients (``1 / accumulate``); ``16-mixed``'s loss scale is applied here, as
        the door's backward would apply it. ``run`` replaces the schedule's own step (default).
        """
        assert self.pipeline is not None
        scaler = self.precision.scaler
        if scaler is not None:  # scale() of a one: the scaler's current scale (its first call creates it)
            scale *= float(scaler.scale(torch.ones((), device=self.device)))
        inputs, target, weight = cut_pair(self.context_parallel, inputs, target)
        step = run or self.pipeline.train_step
        with self.precision.forward_context():
            # The schedule's loss is the mean over microbatches of this rank's own mean loss (it divides the
            # scale back out); weighted, as a step without stages returns it.
            return step(inputs, target, float(scale * weight)) * weight

    def pipeline_eval_step(self, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Forward only through this rank's stages; this rank's loss, weighted as in training."""
        assert self.pipeline is not None
        inputs, target, weight = cut_pair(self.context_parallel, inputs, target)
        with torch.no_grad(), self.precision.forward_context():
            return self.pipeline.eval_step(inputs, target) * weight

    def refuse_unsharded_checkpoint(self, path: Any, owner: str, call: str) -> None:
        """With pipeline stages only sharded checkpoints resume (each stage reads its own parameters by name)."""
        if self.pipeline is None or not (path.is_file() or is_deepspeed_checkpoint(path)):
            return
        kind = "a one-file checkpoint" if path.is_file() else "a DeepSpeed checkpoint"
        raise ValueError(
            f"{owner}(pipeline_parallel_size={self.config.pipeline_parallel_size}) resumes sharded checkpoints"
            f" only, and {call}={str(path)!r} is {kind}. Resume it once without pipeline stages and save it"
            f" sharded ({owner}(checkpoint='sharded')), or start from its weights"
            " (lightning_shard.checkpoint.load_model_weights)."
        )
