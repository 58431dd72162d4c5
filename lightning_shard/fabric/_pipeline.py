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

from torch import nn

from lightning_shard.core.session import Session
from lightning_shard.core.transform import LossFn


def check_pipeline_call(
    call: str, session: Session | None, model: nn.Module, loss_fn: LossFn | None
) -> LossFn:
    """``fabric.strategy.<call>(model, inputs, target)``: what must hold, and the loss of one microbatch."""
    if session is not None and session.cut_by_loop:
        raise ValueError(
            f"fabric.strategy.{call}(model, inputs, target) cuts the sequences over the context-parallel"
            " group itself, but the loop cut a batch with fabric.strategy.cut_batch: pass the whole batch"
            " (call fabric.strategy.end_cut() if a cut batch was used elsewhere)."
        )
    if session is None or session.pipeline is None:
        raise RuntimeError(
            f"fabric.strategy.{call}(...) runs a batch through pipeline stages: it needs"
            " ShardFabricStrategy(pipeline_parallel_size>1) and the model set up with fabric.setup first."
            " Without pipeline stages, call the model and fabric.backward(loss)."
        )
    if getattr(model, "_forward_module", model) is not session.model:
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
    return loss_fn


def refuse_backward_under_pipeline(session: Session) -> None:
    if session.pipeline is not None:
        raise RuntimeError(
            "ShardFabricStrategy(pipeline_parallel_size>1): fabric.backward has nothing to do, because"
            " fabric.strategy.pipeline_step(model, inputs, target) runs every microbatch's backward and returns"
            " the loss detached. Call the optimizer step after it, without fabric.backward."
        )


def as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
