"""Pipeline stages in a Fabric loop: the model cut at set-up, and one explicit call per batch.

A Fabric loop has no ``training_step`` for the schedule to run in place of, so each batch goes through
``fabric.strategy.pipeline_step(model, inputs, target)``: forward and backward of every microbatch on this
rank's stages under the schedule the flags name; the loss (the mean over microbatches) comes back on every
stage, and the gradients are in ``.grad`` as after ``fabric.backward``. Clipping, the optimizer step,
``zero_grad``, accumulation (``fabric.no_backward_sync``) and checkpoints are the loop's usual calls. The
cut and the stage runner are made by the core's :func:`~lightning_shard.core.transform` (over
:mod:`lightning_shard.pipeline`), as for the Trainer; docs/fabric.md shows the loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.context_parallel.batch import group_mean
from lightning_shard.core.processes import guarded
from lightning_shard.core.session import Session
from lightning_shard.core.transform import PIPELINE_KEY, LossFn, pipeline_rank
from lightning_shard.pipeline import StageRunner


class FabricPipeline:
    """What :class:`~lightning_shard.fabric.ShardFabricStrategy` adds for ``pipeline_parallel_size > 1``."""

    config: ShardConfig
    device_mesh: Any
    root_device: torch.device
    precision: Any
    _model: nn.Module | None
    _pipeline: StageRunner | None = None
    _loss_fn: LossFn | None = None
    _session: Session
    _cut_by_loop: bool = False  # the context-parallel mixin's: the loop cut a batch itself
    context_parallel: ContextParallel | None

    @property
    def pipeline_stage(self) -> int | None:
        """This rank's pipeline stage (``None`` without pipeline stages)."""
        return pipeline_rank(self.device_mesh)

    def _call_loss(self, output: Any, target: Any) -> Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    @guarded
    def pipeline_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None = None, scale: float = 1.0
    ) -> Tensor:
        """Forward and backward of one batch through this rank's pipeline stages; its loss on every stage.

        Args:
            model: the model ``fabric.setup`` returned.
            inputs: the first stage's positional arguments (a tensor or a tuple of them); the last stage
                may pass anything, as only the first stage reads them.
            target: what ``loss_fn`` compares the last stage's output with.
            loss_fn: ``loss_fn(output, target) -> Tensor``, the mean loss of one microbatch; by default the
                model's ``pipeline_loss`` (the Trainer strategy's contract, docs/pipeline.md).
            scale: the gradients are ``scale x`` those of the batch's loss (``1 / accumulate`` under
                accumulation); the returned loss is not scaled.

        With ``context_parallel_size > 1`` the inputs and the target (both ``(batch, sequence, ...)``, the
        target aligned with the inputs position by position) are cut to this rank's chunks, as
        ``cut_batch`` cuts (do not cut them first); each rank's loss is weighted by its share of the
        targets, and the loss returned is the group's: the whole sequences' loss.
        """
        self._stage_runner(model, "pipeline_step", loss_fn)
        # 16-mixed's loss scale, the cut over the context-parallel group and its weight: the session's step.
        loss = self._session.pipeline_train_step(_as_tuple(inputs), target, scale)
        return group_mean(self.context_parallel, loss)

    @guarded
    def pipeline_eval_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None = None
    ) -> Tensor:
        """Forward only, through this rank's stages; the batch's loss on every stage."""
        self._stage_runner(model, "pipeline_eval_step", loss_fn)
        return group_mean(self.context_parallel, self._session.pipeline_eval_step(_as_tuple(inputs), target))

    def _stage_runner(self, model: nn.Module, call: str, loss_fn: LossFn | None) -> StageRunner:
        if self._cut_by_loop:
            raise ValueError(
                f"fabric.strategy.{call}(model, inputs, target) cuts the sequences over the context-parallel"
                " group itself, but the loop cut a batch with fabric.strategy.cut_batch: pass the whole batch"
                " (call fabric.strategy.end_cut() if a cut batch was used elsewhere)."
            )
        if self._pipeline is None:
            raise RuntimeError(
                f"fabric.strategy.{call}(...) runs a batch through pipeline stages: it needs"
                " ShardFabricStrategy(pipeline_parallel_size>1) and the model set up with fabric.setup first."
                " Without pipeline stages, call the model and fabric.backward(loss)."
            )
        if getattr(model, "_forward_module", model) is not self._model:
            raise ValueError(
                f"fabric.strategy.{call}(model, ...) takes the model fabric.setup returned; got"
                f" {type(model).__name__}, which is not it."
            )
        if loss_fn is None:
            module = getattr(model, "_original_module", model)
            loss_fn = getattr(module, "pipeline_loss", None)
            if not callable(loss_fn):
                raise ValueError(
                    f"fabric.strategy.{call}(model, inputs, target) needs the loss of one microbatch: pass"
                    f" loss_fn=callable(output, target) -> Tensor, or define {type(module).__name__}.pipeline_loss."
                )
        self._loss_fn = loss_fn
        return self._pipeline

    def _refuse_backward_under_pipeline(self) -> None:
        if self._pipeline is not None:
            raise RuntimeError(
                "ShardFabricStrategy(pipeline_parallel_size>1): fabric.backward has nothing to do, because"
                " fabric.strategy.pipeline_step(model, inputs, target) runs every microbatch's backward and returns"
                " the loss detached. Call the optimizer step after it, without fabric.backward."
            )

    def _mark_pipeline(self, others: dict[str, Any]) -> None:
        if self._pipeline is not None:
            others[PIPELINE_KEY] = self.config.pipeline_parallel_size


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
