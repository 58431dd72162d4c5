"""What a LightningModule meets to run in pipeline stages (``pipeline_parallel_size > 1``), and its batches.

Set-up cuts the LightningModule to this rank's stage before the engine shards it (so FSDP2, tensor
parallelism and the optimizers see only the stage's parameters), then builds the stage runner on the
sharded module (:func:`lightning_shard.core.prepare`). Each training step runs the schedule in place of
``training_step`` (the session's :meth:`~lightning_shard.core.Session.pipeline_train_step`): it does forward
and backward for every microbatch, so Lightning's backward only adds the gradients it made, while the optimizer
step, gradient clipping (one norm over every stage: :func:`lightning_shard.parallel.clip_grad_norm_`) and
``zero_grad`` go through Lightning as usual. The contract is in docs/pipeline.md and :func:`check_contract`.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor

from lightning_shard.context_parallel.batch import group_mean
from lightning_shard.core import Session


def check_contract(module: L.LightningModule, stages: int) -> None:
    """What a LightningModule defines to run in pipeline stages, or a ``ValueError`` naming what to add."""
    name = type(module).__name__
    if not callable(getattr(module, "pipeline_loss", None)):
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size={stages}) needs {name}.pipeline_loss(output, target) -> Tensor:"
            " the loss of one microbatch from the last stage's output (a mean over its samples, as"
            " training_step would compute it). Add the method (see docs/pipeline.md), or use"
            " pipeline_parallel_size=1."
        )
    if not module.automatic_optimization:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size={stages}) runs forward and backward through the pipeline"
            f" schedule, which manual optimization ({name}.automatic_optimization = False) would bypass. Use"
            " automatic optimization, or pipeline_parallel_size=1."
        )


def split_batch(module: L.LightningModule, batch: Any) -> tuple[tuple[Any, ...], Any]:
    """``(inputs, target)`` of a batch: the module's ``pipeline_batch(batch)``, or the batch itself as a pair.
    ``inputs`` (a tensor or a tuple of them) are the first stage's positional arguments."""
    custom = getattr(module, "pipeline_batch", None)
    pair = custom(batch) if callable(custom) else batch
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size>1) takes each batch as (inputs, target), but"
            f" {type(module).__name__} got a {type(pair).__name__}. Define"
            f" {type(module).__name__}.pipeline_batch(batch) -> (inputs, target) (see docs/pipeline.md)."
        )
    inputs, target = pair
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def predict_inputs(module: L.LightningModule, batch: Any) -> tuple[Any, ...]:
    """The first stage's arguments for ``predict``: ``pipeline_batch(batch)[0]``, the first of an
    ``(inputs, target)`` pair, or the batch itself."""
    if callable(getattr(module, "pipeline_batch", None)):
        inputs = split_batch(module, batch)[0]
        return inputs
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        batch = batch[0]
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def pipeline_train_step(
    session: Session, module: L.LightningModule, batch: Any, context_parallel: Any
) -> Tensor:
    """The schedule's forward and backward of every microbatch, in place of ``training_step``; the loss logged
    as ``train_loss`` (over a context-parallel group, the whole sequences' loss)."""
    # Lightning's division by accumulate_grad_batches is the scale, and Lightning zeroes gradients before its
    # backward: the schedule's gradients are held until then (``hold``).
    scale = 1.0 / module.trainer.accumulate_grad_batches
    loss = session.pipeline_train_step(*split_batch(module, batch), scale, hold=True)
    module.log("train_loss", group_mean(context_parallel, loss), prog_bar=True)
    return loss


def pipeline_eval_step(session: Session, module: L.LightningModule, batch: Any, name: str) -> Tensor:
    """The schedule's forward only, in place of ``validation_step`` / ``test_step``; the loss logged as ``name``."""
    loss = session.pipeline_eval_step(*split_batch(module, batch))
    # Every stage holds the same value: the mean over all ranks is the data-parallel mean (and over a
    # context-parallel group, of weighted losses, the whole sequences' loss).
    module.log(name, loss, sync_dist=True)
    return loss
