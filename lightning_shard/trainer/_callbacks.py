"""Lightning's own callbacks and tuner under ShardStrategy: what it must adapt so they report as under DDP.

Checked on 2 gloo ranks against ``DDPStrategy`` (tests/test_lightning_callbacks_multirank.py; the table is in
docs/callbacks.md). ``EarlyStopping``, ``ModelCheckpoint`` + ``test(ckpt_path="best")``, ``BasePredictionWriter``,
``Timer`` and ``OnExceptionCheckpoint`` need nothing. What differs, and why:

- ``ModelSummary`` counts ``p.numel()``; DeepSpeed ZeRO-3 leaves each partitioned parameter with size-0 data
  (its size is ``ds_numel``), so the table reads 0 parameters. Lightning uses its ``DeepSpeedSummary`` only
  under its own ``DeepSpeedStrategy``. :class:`ShardSummary` counts what each parameter stands for (FSDP2's
  DTensors already report their global size) and names FSDP2-wrapped layers by the user's class.
- ``LearningRateMonitor`` names its keys after the optimizer's class: at stage 1 the optimizer is torch's
  ``ZeroRedundancyOptimizer`` over the user's, and ``lr-SGD`` became ``lr-ZeroRedundancyOptimizer``; the
  engine now builds it under the user's class name (``engines.fsdp.zero.named_zero_class``).
- ``Tuner.lr_find`` / ``LearningRateFinder`` put a torch LR scheduler on ``strategy.optimizers[0]``; DeepSpeed's
  ZeRO optimizer is not a torch ``Optimizer`` ("DeepSpeedZeroOptimizer is not an Optimizer"). The search runs
  on the torch optimizer DeepSpeed steps (its learning rates are the ones DeepSpeed uses).
- ``GradientAccumulationScheduler`` changes ``trainer.accumulate_grad_batches`` between epochs; DeepSpeed fixes
  ``gradient_accumulation_steps`` when its engine is built and silently steps at the old boundary: refused.

:func:`adapt` does all of it, and refuses Lightning's averaging callbacks where they cannot work
(:mod:`lightning_shard.trainer._refused_callbacks`) and feeds ``ThroughputMonitor`` its FLOPs
(:func:`lightning_shard.callbacks.feed_throughput_monitor`); ShardStrategy calls it at the end of ``setup``
(once the optimizers exist).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelCheckpoint,
    ModelSummary,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, _tensor_has_shape
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_shard.callbacks.throughput import feed_throughput_monitor
from lightning_shard.checkpoint.storage import resolve
from lightning_shard.engines import declared
from lightning_shard.trainer._refused_callbacks import check_callbacks

#: Set on a LearningRateFinder whose search already runs on the torch optimizer (later Trainer calls find it).
_ADAPTED = "_lightning_shard_adapted"


def adapt(trainer: Any, strategy: Any) -> None:
    """Make Lightning's callbacks among ``trainer.callbacks`` report under ``strategy`` as under DDP, or raise
    ``ValueError`` for one that cannot work with its engine. Idempotent: call it at every ``setup``."""
    engine, stage = strategy.engine_name, strategy.stage
    caps = declared(engine)
    if trainer.state.fn == TrainerFn.FITTING:
        # Tensor parallelism makes parameters DTensors at any stage: as at stage 3 for the averaging checks.
        check_callbacks(
            trainer,
            f"ShardStrategy(stage={stage}, engine={engine!r})",
            3 if strategy.config.tensor_parallel_size > 1 else stage,
            engine,
        )
        feed_throughput_monitor(trainer)  # Lightning's ThroughputMonitor logs MFU with no user code
    if caps.owns_step:  # it fixes its accumulation steps when it is built
        _refuse_accumulation_schedule(trainer, f"ShardStrategy(stage={stage}, engine={engine!r})", caps.label)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            # Before the first step, not at the first save an hour in.
            resolve(callback.dirpath, f"{type(callback).__name__}(dirpath)")
        if isinstance(callback, ModelSummary):
            use_shard_summary(callback)
        elif isinstance(callback, LearningRateFinder) and not caps.torch_optimizer:
            search_on_torch_optimizer(callback)


# --- ModelSummary --------------------------------------------------------------------------------------------


def parameter_count(p: torch.Tensor) -> int:
    """Elements ``p`` stands for: its whole size, wherever it is sharded (DeepSpeed ZeRO-3: ``ds_numel``;
    an FSDP2 DTensor: its global ``numel()``); 0 for a lazy parameter, as Lightning counts it."""
    if _tensor_has_shape(p):
        return 0
    return int(getattr(p, "ds_numel", p.numel()))


def _user_class(module: nn.Module) -> type:
    """The user's class of a module FSDP2 wrapped (``fully_shard`` swaps in ``FSDP<Class>``)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


class ShardLayerSummary(LayerSummary):
    """One row of :class:`ShardSummary`: whole parameter counts and the user's class name."""

    @property
    @override
    def layer_type(self) -> str:
        return _user_class(self._module).__name__

    @property
    @override
    def num_parameters(self) -> int:
        return sum(parameter_count(p) for p in self._module.parameters())


class ShardSummary(Summary):
    """Lightning's model summary with the counts of the whole model, however its parameters are sharded.

    The columns are the ones Lightning shows under DDP (FLOPs and sizes come from the same forward of
    ``example_input_array``, run on every rank: sharded parameters are gathered by collectives)."""

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, LayerSummary] = OrderedDict(
            (name, ShardLayerSummary(module)) for name, module in self.named_modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        return sum(parameter_count(p) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(parameter_count(p) for p in self._model.parameters() if p.requires_grad)


def _shard_summary(callback: ModelSummary, trainer: Any, pl_module: Any) -> Summary:
    return ShardSummary(pl_module, max_depth=callback._max_depth)


def use_shard_summary(callback: ModelSummary) -> None:
    """Have a ``ModelSummary`` callback (or ``RichModelSummary``) build a :class:`ShardSummary`.

    A subclass with its own ``_summary`` keeps it: its author chose what to count."""
    if type(callback)._summary is ModelSummary._summary:
        callback._summary = functools.partial(_shard_summary, callback)  # type: ignore[method-assign]


# --- Tuner.lr_find / LearningRateFinder ----------------------------------------------------------------------


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer DeepSpeed steps inside its ZeRO optimizer (its param groups hold the learning rates
    DeepSpeed uses); ``optimizer`` itself when it wraps none."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def search_on_torch_optimizer(callback: LearningRateFinder) -> None:
    """Run a ``LearningRateFinder``'s search (``Tuner.lr_find`` adds one) with ``strategy.optimizers`` showing
    the torch optimizers DeepSpeed steps, on which Lightning can put its search's LR scheduler; the strategy's
    own list is back in place once the search is over."""
    if getattr(callback, _ADAPTED, False):
        return
    search = callback.lr_find

    @functools.wraps(search)
    def lr_find(trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        engine_optimizers = list(strategy.optimizers)
        strategy.optimizers = [torch_optimizer(opt) for opt in engine_optimizers]
        try:
            search(trainer, pl_module)
        finally:
            strategy.optimizers = engine_optimizers

    callback.lr_find = lr_find  # type: ignore[method-assign]
    setattr(callback, _ADAPTED, True)


# --- GradientAccumulationScheduler ---------------------------------------------------------------------------


def _refuse_accumulation_schedule(trainer: Any, description: str, engine_label: str) -> None:
    fixed = trainer.accumulate_grad_batches
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler) and set(callback.scheduling.values()) != {
            fixed
        }:
            raise ValueError(
                f"{description} cannot follow Lightning's GradientAccumulationScheduler({callback.scheduling}):"
                f" {engine_label} fixes gradient_accumulation_steps when it builds its engine, and would step at the"
                f" boundary of accumulate_grad_batches={fixed} whatever the schedule says. Use engine='fsdp', or"
                " one value for the whole run: Trainer(accumulate_grad_batches=N) without the callback."
            )
