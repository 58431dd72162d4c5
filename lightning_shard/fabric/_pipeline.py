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

from lightning_shard.checkpoint.layout import is_deepspeed_checkpoint
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel
from lightning_shard.context_parallel.batch import cut_pair, group_mean
from lightning_shard.core.processes import guarded
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
        runner = self._stage_runner(model, "pipeline_step", loss_fn)
        scaler = (
            self.precision.shard.scaler
        )  # 16-mixed: the schedule's backward scales as fabric.backward would
        if scaler is not None:  # scale() of a one: the scaler's current scale (its first call creates it)
            scale *= float(scaler.scale(torch.ones((), device=self.root_device)))
        # Context parallelism: each rank runs its chunks of the sequences, its loss weighted by its share.
        inputs, target, weight = cut_pair(self.context_parallel, _as_tuple(inputs), target)
        with self.precision.forward_context():
            loss = runner.train_step(inputs, target, float(scale * weight))
        return group_mean(self.context_parallel, loss * weight)

    @guarded
    def pipeline_eval_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None = None
    ) -> Tensor:
        """Forward only, through this rank's stages; the batch's loss on every stage."""
        runner = self._stage_runner(model, "pipeline_eval_step", loss_fn)
        inputs, target, weight = cut_pair(self.context_parallel, _as_tuple(inputs), target)
        with torch.no_grad(), self.precision.forward_context():
            loss = runner.eval_step(inputs, target)
        return group_mean(self.context_parallel, loss * weight)

    def _stage_runner(self, model: nn.Module, call: str, loss_fn: LossFn | None) -> StageRunner:
        if getattr(self, "_cut_by_loop", False):
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

    def _refuse_unsharded_under_pipeline(self, path: Any, call: str) -> None:
        if self._pipeline is not None and (path.is_file() or is_deepspeed_checkpoint(path)):
            kind = "a one-file checkpoint" if path.is_file() else "a DeepSpeed checkpoint"
            raise ValueError(
                f"ShardFabricStrategy(pipeline_parallel_size={self.config.pipeline_parallel_size}) loads sharded"
                f" checkpoints only, and {call}({str(path)!r}) is {kind}. Load it once without pipeline stages"
                " and save it sharded, or start from its weights (lightning_shard.checkpoint.load_model_weights)."
            )


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
