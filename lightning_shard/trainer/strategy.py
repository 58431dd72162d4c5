"""ShardStrategy: ZeRO stages 0-3 for any LightningModule, on CPU (gloo) and CUDA (nccl).

The Trainer door. It validates the flags before any process starts; its processes and collectives are the
core's :class:`~lightning_shard.core.ProcessGroups`, the one base it shares with the Fabric door beside the
framework's own ``ParallelStrategy``. At set-up :func:`~lightning_shard.core.prepare` transforms the model and
returns the run's :class:`~lightning_shard.core.Session`; every hook below forwards to it (steps, backward, the
optimizer step, accumulation, checkpoints) and keeps only what is Lightning's: its loop order, hooks and logging.
The pipeline contract a LightningModule meets is in :mod:`lightning_shard.trainer._pipeline`.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard import _ddp
from lightning_shard.checkpoint.storage import Location, follow_alias, resolve
from lightning_shard.context_parallel import scale_loss
from lightning_shard.core import ProcessGroups, Session, guarded, transform
from lightning_shard.core.lifecycle import EngineLifecycle
from lightning_shard.core.process_groups import reduce_tensor
from lightning_shard.engines import Engine, TrainSettings, check, configure
from lightning_shard.fabric import ShardFabricStrategy
from lightning_shard.fault_tolerance.replicas import ReplicaGroups
from lightning_shard.flags import args_doc, bind, takes_flags
from lightning_shard.planner import auto_stage
from lightning_shard.trainer import _compat as trainer_compat
from lightning_shard.trainer import _contexts as init_contexts
from lightning_shard.trainer import _fault_tolerance as fault_tolerance
from lightning_shard.trainer._callbacks import adapt as adapt_lightning_callbacks
from lightning_shard.trainer._checkpoint import (
    last_on_object_stores,
    save_checkpoint,
    weights_only_given,
    with_module_state,
)
from lightning_shard.trainer._data import position_loader
from lightning_shard.trainer._pipeline import (
    check_contract,
    pipeline_train_step,
)
from lightning_shard.trainer._preemption import Preemption
from lightning_shard.trainer._processes import TrainerLauncher
from lightning_shard.trainer._steps import backward, evaluate, optimizer_step, predict, warn_recompiles
from lightning_shard.trainer.precision import ShardPrecision

log = logging.getLogger(__name__)
trainer_compat.record_weights_only()  # fit(ckpt_path=..., weights_only=...) reaches load_checkpoint


class ShardStrategy(ProcessGroups, ParallelStrategy):
    """Train any LightningModule with ZeRO-style sharding, chosen by flag.

    What each stage shards, and the bytes per rank, are in the ZeRO table of docs/strategy.md ("Memory per
    rank"). The flags (the ``Args`` below) are declared once, in :class:`lightning_shard.flags.ShardFlags`.

    Models larger than one device: build them under ``trainer.init_module(empty_init=True)`` or in
    ``configure_model``; their parameters stay on the meta device until set-up shards them and
    allocates each rank's part (see docs/large_models.md and :mod:`lightning_shard._meta`).
    """

    strategy_name = "shard"
    ends_together = (SIGTERMException,)  # raised on every rank after the same step (preemption)
    launcher_class = TrainerLauncher
    process_dataloader = position_loader  # the training loader read on where a restored loop is

    @takes_flags
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        flags, kwargs = bind("ShardStrategy", args, kwargs)
        kwargs, ddp_kwargs = _ddp.split_kwargs(kwargs)
        self.config = configure(ddp_kwargs=ddp_kwargs, **vars(flags))
        self._engines = EngineLifecycle(self.config)  # asked by precision, set-up, accumulation, exit
        super().__init__(**kwargs)
        self._session: Session | None = None
        self._preemption = Preemption()
        self._empty_init = False  # init_module(empty_init=True) was used: configure_model builds empty too
        self._replicas: ReplicaGroups | None = None  # fault_tolerance: this replica group, while fitting

    __doc__ = (__doc__ or "").rstrip() + "\n\n" + args_doc() + "\n"

    def fabric(self) -> ShardFabricStrategy:
        """The same flags as a Lightning Fabric strategy: ``L.Fabric(strategy=ShardStrategy(...).fabric())``."""
        return ShardFabricStrategy.from_config(self.config)

    def __repr__(self) -> str:
        # Fabric's "invalid strategy" error prints this: it names the Fabric twin.
        return (
            f"ShardStrategy(stage={self.config.stage!r}, engine={self.config.engine!r}) (a Trainer strategy; for"
            " lightning.Fabric pass ShardFabricStrategy(...) with the same arguments, or ShardStrategy(...).fabric())"
        )

    # --- precision -------------------------------------------------------------------------------

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ShardPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardPrecision.over(self._engines.default_precision())
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from Trainer(precision=...).
        engine, stage = self._engines.kind, self.config.stage
        self._precision_plugin = None if plugin is None else ShardPrecision.for_engine(plugin, engine, stage)

    # --- model side -------------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        self._empty_init = True  # configure_model, run later by fit, then builds straight into shards too
        with init_contexts.on_meta(self):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with init_contexts.into_shards(self):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # --- model and optimizers --------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.stage == "auto":
            stage, policy = auto_stage.choose_for(self, trainer)
            self.config = self.config.replace(stage=stage, activation_checkpointing=policy)
            check(self.config, self._engines.capabilities)  # what 'auto' left open, at the chosen stage
        if self.pipeline_stage is not None:
            check_contract(self._lm, self.config.pipeline_parallel_size)  # before the cut
        transform.prepare_precision(self.precision_plugin.policy, self)
        earlier, policy = self._session, self.precision_plugin.policy
        engine = self._engines.reusable()
        loss_fn = getattr(self._lm, "pipeline_loss", None)  # checked above, with pipeline stages
        self._session = transform.prepare(self._lm, self.config, policy, self, engine=engine, loss_fn=loss_fn)
        self._session.carry_over(earlier)  # skipped steps count over calls; the replica group outlives one
        self.model, self.config = self._session.model, self._session.config
        self._engines.adopt(self._session.engine)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._replicas = fault_tolerance.start(self, trainer)
        self.setup_precision_plugin()
        # Lightning's own callbacks and tuner report as under DDPStrategy, or are refused with the fix.
        adapt_lightning_callbacks(trainer, self)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._preemption.install(self._lm.trainer)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        # Re-made on every fit: the optimizers must hold the parameters of the module as now wrapped.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)  # the user's configure_optimizers
        assert self.model is not None
        settings = TrainSettings(
            trainer.accumulate_grad_batches, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        )
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        session = self._live()
        self.optimizers = session.setup_optimizers(list(self.optimizers), schedulers, settings)
        self.model = session.model

    def state_bytes(self) -> dict[str, Any]:
        """This rank's bytes of model state: ``{"parameters" | "gradients" | "optimizer": {"accelerator",
        "host", "nvme"}, "total": int}``, the same shape for every engine."""
        assert self.model is not None
        return self._engines.state_bytes(self.model, self.optimizers)

    @override
    def teardown(self) -> None:
        """End of a Trainer call: the engine commits pending checkpoints and removes its files; the groups
        live on until exit, as under ``DDPStrategy`` (:mod:`lightning_shard.core.processes`)."""
        try:
            if self._session is not None:
                self._session.end_cut()  # the model runs whole sequences outside the Trainer's steps
            self._engines.end_call()  # the engine is kept for inspection; the next call builds a fresh one
            fault_tolerance.end(self._replicas)
            self.end_barrier()
        finally:
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    def _destroy_world(self) -> None:
        self._engines.destroy_world()  # DeepSpeed's drops its cached groups too

    def _release_at_exit(self) -> None:
        self._engines.release("ShardStrategy")
        super()._release_at_exit()

    # --- the session: every step forwarded to it -----------------------------------------------------

    @property
    def _lm(self) -> L.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module

    def _live(self) -> Session:
        if self._session is None:
            raise RuntimeError(
                "ShardStrategy: the run is only available once the Trainer has set the model up."
            )
        return self._session

    @property
    def engine(self) -> Engine:
        return self._live().engine

    def _writes_checkpoints(self) -> bool:
        return self._session is None or self._session.writes_checkpoints()

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: a custom strategy must say so to get a DistributedSampler.
        return True

    @override
    @guarded
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        return reduce_tensor(tensor, group, reduce_op)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # An engine that owns the step counts micro-batches itself and steps at the boundary.
        return self._engines.owns_step

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    @guarded
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        session, module = self._live(), self._lm
        self._preemption.agree(self.root_device)
        fault_tolerance.before_batch(self._replicas)  # the quorum asked for after the last step, settled
        if session.pipeline is not None:
            return pipeline_train_step(session, module, args[0], self.context_parallel)
        args, weight = session.cut(args)
        with self.precision_plugin.train_step_context():
            return scale_loss(session.call(module, "training_step", *args, **kwargs), weight)

    @override
    @guarded
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return evaluate(self._live(), self._lm, self.precision_plugin, "validation_step", args, kwargs)

    @override
    @guarded
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return evaluate(self._live(), self._lm, self.precision_plugin, "test_step", args, kwargs)

    @override
    @guarded
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return predict(self._live(), self._lm, self.precision_plugin, args, kwargs)

    @override
    @guarded
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        plugin, module = self.precision_plugin, self._lm
        plain = lambda loss: plugin.backward(loss, module, optimizer, *args, **kwargs)  # noqa: E731
        return backward(self._live(), module, plugin, closure_loss, plain)

    @override
    @guarded
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._replicas is not None:  # the step only if it commits on every replica group
            return fault_tolerance.step(self, self._replicas, optimizer, closure, model, **kwargs)
        return self._optimizer_step(optimizer, closure, model, **kwargs)

    def _optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        lightning_step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        plugin, owns_step = self.precision_plugin, self._engines.owns_step
        return optimizer_step(self._live(), self._lm, plugin, optimizer, closure, lightning_step, owns_step)

    @property
    def replica_group(self) -> ReplicaGroups | None:  # fault_tolerance: participants, discarded, heals
        return self._replicas

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite values (``skip_nonfinite=True``)."""
        return 0 if self._session is None else self._session.skipped_steps

    @property
    def recompiles(self) -> int:
        """``compile=...``: blocks dynamo compiled again after their first graph, since set-up, on this rank."""
        return 0 if self._session is None else self._session.recompiles

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        warn_recompiles(self.recompiles)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._session.no_sync() if self._session is not None else nullcontext():
            yield

    # --- checkpoints: the session's engine writes and reads every kind --------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._live().model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._live().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint(), straight into the sharded layout

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        save_checkpoint(self, checkpoint, filepath, storage_options)

    @guarded
    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, exception: bool) -> None:
        location = self._checkpoint_location(filepath, "save_checkpoint(filepath)")
        self._live().save(self.optimizers, checkpoint, location, exception=exception)

    def _checkpoint_location(self, filepath: Any, argument: str) -> Location:
        """The one checkpoint every rank writes into or reads: rank 0's path (a rank's own name for it, such
        as a per-rank temporary directory, would split the checkpoint). A strategy whose ranks each keep
        their own copy of the checkpoint overrides this (``lightning_shard.ray``)."""
        return resolve(self.broadcast(str(filepath)), argument)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._writes_checkpoints():  # with fault tolerance, the lowest live group only
            self._engines.remove_checkpoint(resolve(filepath, "remove_checkpoint(filepath)"))

    @override
    @guarded
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = follow_alias(self._checkpoint_location(checkpoint_path, "ckpt_path"))
        if weights_only is None:
            weights_only = weights_only_given(self.lightning_module)
        checkpoint = self._live().load(self.optimizers, path, weights_only, "ShardStrategy", "ckpt_path")
        fault_tolerance.load_outer(self._replicas, checkpoint)
        return with_module_state(checkpoint, self._lm, self.config.engine)


trainer_compat.resolve_last_checkpoint(partial(last_on_object_stores, ShardStrategy))
