"""How ShardStrategy runs a step with pipeline stages (``pipeline_parallel_size > 1``).

Set-up cuts the LightningModule to this rank's stage before the engine shards it (so FSDP2, tensor
parallelism and the optimizers see only the stage's parameters), then builds the stage runner on the
sharded module. Each training step runs the schedule in place of ``training_step``: it does forward and
backward for every microbatch, so Lightning's backward is a no-op for that step, while the optimizer
step, gradient clipping (one norm over every stage: :func:`lightning_shard.parallel.clip_grad_norm_`)
and ``zero_grad`` go through Lightning as usual. The contract a LightningModule meets is in
docs/pipeline.md and :func:`check_contract`.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer import call
from torch import Tensor
from typing_extensions import override

from lightning_shard.checkpoint.storage import follow_alias, resolve
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel.batch import cut_pair, gather_outputs, group_mean
from lightning_shard.core.processes import guarded
from lightning_shard.core.session import Session
from lightning_shard.core.transform import PIPELINE_KEY, pipeline_rank
from lightning_shard.pipeline import StageRunner
from lightning_shard.trainer._steps import EngineSteps

log = logging.getLogger(__name__)


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


class PipelineSteps(EngineSteps):
    """Lightning's step hooks, run through a pipeline schedule when ``pipeline_parallel_size > 1``."""

    config: ShardConfig
    _pipeline: StageRunner | None = None
    #: The gradients of the schedule's last step, held until Lightning's backward (see ``_train_schedule``).
    _pending: list[tuple[Tensor, Tensor | None]] | None = None
    _session: Session

    @property
    def pipeline_stage(self) -> int | None:
        """This rank's pipeline stage (``None`` without pipeline stages)."""
        return pipeline_rank(self.device_mesh)

    def _check_pipeline_contract(self) -> None:
        """Before set-up cuts the module to this rank's stages: what the LightningModule and precision must meet."""
        stages = self.config.pipeline_parallel_size
        if self.pipeline_stage is None:
            return
        check_contract(self._lm, stages)

    @override
    @guarded
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        self._preemption.agree(self.root_device)
        module = self._lm
        # Lightning divides the returned loss by accumulate_grad_batches before its backward, and 16-mixed's
        # loss scaler multiplies it by its scale; the schedule runs that backward itself, so the session's step
        # applies both (the scaler then unscales, checks for infs over every stage's gradients and steps).
        scale = 1.0 / module.trainer.accumulate_grad_batches
        inputs, target = split_batch(module, args[0])
        loss = self._session.pipeline_train_step(inputs, target, scale, run=self._train_schedule)
        module.log("train_loss", group_mean(self.context_parallel, loss), prog_bar=True)
        return loss

    def _train_schedule(self, inputs: tuple[Any, ...], target: Any, scale: float) -> Tensor:
        """Run the schedule with the gradients it makes kept apart until :meth:`backward`.

        Lightning zeroes gradients between ``training_step`` and backward (at the first batch of each
        accumulation window); the schedule runs its backward inside ``training_step``, so its gradients
        wait aside and are added at backward, the order Lightning's loop expects.
        """
        assert self._pipeline is not None and self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss = self._pipeline.train_step(inputs, target, scale)
            self._pending = [(p, p.grad) for p in params]
        finally:
            for p, grad in zip(params, held, strict=True):
                p.grad = grad
        return loss

    def _add_pending_gradients(self) -> None:
        pending, self._pending = self._pending or [], None
        for p, grad in pending:
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)

    @override
    @guarded
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran every microbatch's backward inside training_step; the hooks still run around it.
        trainer = self._lm.trainer
        call._call_callback_hooks(trainer, "on_before_backward", closure_loss)
        call._call_lightning_module_hook(trainer, "on_before_backward", closure_loss)
        self._add_pending_gradients()
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        return closure_loss

    @override
    @guarded
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._eval_step("val_loss", args[0])

    @override
    @guarded
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._eval_step("test_loss", args[0])

    @override
    @guarded
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        inputs = predict_inputs(self._lm, args[0])
        inputs = cut_pair(self.context_parallel, inputs, None)[0]
        with self.precision_plugin.predict_step_context():
            output = self._pipeline.predict_step(inputs)
        cp = self.context_parallel
        if cp is None or cp.seq_len is None:
            return output
        # The last stage's output arrives on the CPU; the group's collectives run on the rank's device.
        output = gather_outputs(move_data_to_device(output, self.root_device), cp.seq_len, cp.group, cp.size)
        return move_data_to_device(output, "cpu")

    # --- checkpoints: sharded, resumed on any pipeline layout ----------------------------------------

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self._pipeline is not None:
            # Every stage writes its own parameters and optimizer state, keyed by name; the mark says how
            # many stages wrote it (each optimizer's param groups list only its own stage's parameters,
            # which a resume takes from the live optimizer: FSDPEngine.load_optimizer_state_dict).
            checkpoint[PIPELINE_KEY] = self.config.pipeline_parallel_size
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._pipeline is not None:
            path = follow_alias(resolve(self.broadcast(str(checkpoint_path)), "ckpt_path"))
            self._session.refuse_unsharded_checkpoint(path, "ShardStrategy", "ckpt_path")
        return super().load_checkpoint(checkpoint_path, weights_only)

    def _eval_step(self, name: str, batch: Any) -> Tensor:
        loss = self._session.pipeline_eval_step(*split_batch(self._lm, batch))
        module = self._lm
        # Every stage of a pipeline holds the same value: the mean over all ranks is the data-parallel mean
        # (and over a context-parallel group, of weighted losses, the whole sequences' loss).
        module.log(name, loss, sync_dist=True)
        return loss
