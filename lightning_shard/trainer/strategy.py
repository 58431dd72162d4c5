"""ShardStrategy: ZeRO stages 0-3 for any LightningModule, on CPU (gloo) and CUDA (nccl).

The strategy validates flags before any process starts, builds one engine at set-up
(:mod:`lightning_shard.engines`) and delegates sharding, state dicts and gradient sync to it. Its other
jobs live in the modules named for them: processes, groups and collectives in
:mod:`lightning_shard.core.processes`, step hooks in :mod:`lightning_shard.trainer._steps`, checkpoint hooks in
:mod:`lightning_shard.trainer._checkpoint` (over :mod:`lightning_shard.checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_shard import _ddp
from lightning_shard._meta import parameters_on_meta
from lightning_shard.activation_checkpointing import ActivationCheckpointingConfig
from lightning_shard.config import CheckpointMode, ShardConfig
from lightning_shard.core import CollectiveTimeoutError, transform
from lightning_shard.engines import Engine, TrainSettings, engine_class
from lightning_shard.fabric import ShardFabricStrategy
from lightning_shard.flags import args_doc, bind, takes_flags
from lightning_shard.offload import OffloadDevice
from lightning_shard.planner import auto_stage
from lightning_shard.trainer import _compat as trainer_compat
from lightning_shard.trainer._callbacks import adapt as adapt_lightning_callbacks
from lightning_shard.trainer._checkpoint import CheckpointHooks
from lightning_shard.trainer._pipeline import PipelineSteps
from lightning_shard.trainer._preemption import Preemption
from lightning_shard.trainer.nonfinite import NonFiniteGuard
from lightning_shard.trainer.precision import ShardPrecision, to_policy

log = logging.getLogger(__name__)
trainer_compat.record_weights_only()  # fit(ckpt_path=..., weights_only=...) reaches load_checkpoint


class ShardStrategy(PipelineSteps, CheckpointHooks):
    """Train any LightningModule with ZeRO-style sharding, chosen by flag.

    What each stage shards, and the bytes per rank, are in the ZeRO table of docs/strategy.md
    ("Memory per rank"). The strategy validates its flags into one :class:`ShardConfig`, owns the
    processes and the device mesh, and hands everything else to one engine through the contract in
    :mod:`lightning_shard.engines.base`.

    The flags (the ``Args`` below) are declared once, in :class:`lightning_shard.flags.ShardFlags`, which
    gives this class its signature.

    Models larger than one device: build them under ``trainer.init_module(empty_init=True)`` or in
    ``configure_model``; their parameters stay on the meta device until set-up shards them and
    allocates each rank's part (see docs/large_models.md and :mod:`lightning_shard._meta`).
    """

    strategy_name = "shard"

    @takes_flags
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        flags, kwargs = bind("ShardStrategy", args, kwargs)
        kwargs, ddp_kwargs = _ddp.split_kwargs(kwargs)
        self.config = ShardConfig.from_flags(ddp_kwargs=ddp_kwargs, **vars(flags))
        # Resolved once: the precision setter, the set-up and Lightning's per-batch accumulation check ask it.
        self._engine_class = engine_class(self.config.engine)
        super().__init__(
            **kwargs,
        )
        self._guard = NonFiniteGuard(self.config.max_skipped) if self.config.skip_nonfinite else None
        self._engine: Engine | None = None
        self._engine_live = False
        self._preemption = Preemption()
        self._empty_init = False  # init_module(empty_init=True) was used: configure_model builds empty too

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

    # --- the validated flags ---------------------------------------------------------------------

    @property
    def stage(self) -> int | str:
        """The ZeRO stage (``"auto"`` until setup resolves it)."""
        return self.config.stage

    @property
    def engine_name(self) -> str:
        """The engine that serves the flags (``engine="auto"`` resolved)."""
        return self.config.engine

    @property
    def checkpoint_mode(self) -> CheckpointMode:
        return self.config.checkpoint

    @property
    def activation_checkpointing(self) -> ActivationCheckpointingConfig | None:
        return self.config.activation_checkpointing

    @property
    def offload_optimizer(self) -> OffloadDevice | None:
        return self.config.offload_optimizer

    @property
    def offload_params(self) -> OffloadDevice | None:
        return self.config.offload_params

    # --- precision -------------------------------------------------------------------------------

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ShardPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardPrecision.over(self._engine_class.precision_class())
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from Trainer(precision=...): translate it here, at
        # Trainer construction, so an unsupported precision fails before any process starts.
        if plugin is None:
            self._precision_plugin = None
            return
        policy = self._engine_class.precision_class.from_plugin(to_policy(plugin))
        self._engine_class.check_precision(self.config.stage, policy)
        # The user's own ShardPrecision is kept where the engine runs its policy as it is (the FSDP engine).
        kept = isinstance(plugin, ShardPrecision) and plugin.policy is policy
        self._precision_plugin = plugin if kept else ShardPrecision.over(policy)

    # --- model side -------------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        # Asked for: configure_model, run later by fit, then builds straight into shards too.
        self._empty_init = True
        # Parameters on the meta device until set-up shards them (buffers are built as usual).
        with parameters_on_meta(), self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds on real memory, as under Lightning's DDP and ModelParallel strategies,
        # unless the module was built under init_module(empty_init=True): then straight into shards
        # (parameters on the meta device; DeepSpeed ZeRO-3: zero.Init).
        if not self._empty_init:
            yield
            return
        with self._engine_class.construction_context(self.config, self.precision_plugin.policy):
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
        self._check_pipeline_contract()
        transform.prepare_precision(self.precision_plugin.policy, self)
        prepared = transform.prepare(
            self._lm,
            self.config,
            self.precision_plugin.policy,
            self,
            engine=self._engine if self._engine_live else None,
            loss_fn=getattr(self._lm, "pipeline_loss", None),  # checked above, with pipeline stages
        )
        self._session = prepared
        self.model, self._engine, self.config, self._pipeline = (
            prepared.model,
            prepared.engine,
            prepared.config,
            prepared.pipeline,
        )
        self._engine_live = True
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
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
        self.model, self.optimizers = self.engine.setup_optimizers(
            self.model, list(self.optimizers), schedulers, settings
        )

    def state_bytes(self) -> dict[str, Any]:
        """This rank's bytes of model state: ``{"parameters" | "gradients" | "optimizer": {"accelerator",
        "host", "nvme"}, "total": int}``, the same shape for every engine."""
        assert self.model is not None
        return self.engine.state_bytes(self.model, self.optimizers).as_dict()

    @override
    def teardown(self) -> None:
        """End of a Trainer call: the engine commits pending checkpoints and removes its files. The process
        groups stay alive for collectives in user code and the next call, as under ``DDPStrategy``; they
        are destroyed at exit (:mod:`lightning_shard.core.processes`)."""
        try:
            if self.context_parallel is not None:
                self.context_parallel.end()  # the model runs whole sequences outside the Trainer's steps
            if self._engine is not None and self._engine_live:
                # Kept for inspection after the run; the next Trainer call builds a fresh one.
                self._engine_live = False
                self._engine.teardown()
            self._teardown_barrier()
        finally:
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    def _teardown_barrier(self) -> None:
        """When a Trainer call returns on any rank, every rank has committed its checkpoints and removed its
        files (skipped after a collective failed: the other ranks may be gone)."""
        if self._timed_out or self._device_mesh is None:
            return
        try:
            self.barrier("teardown")
        except CollectiveTimeoutError as error:
            log.error("ShardStrategy: the barrier at the end of the call failed: %s", error)

    def _destroy_world(self) -> None:
        self._engine_class.destroy_world()  # DeepSpeed's drops its cached groups too

    def _release_at_exit(self) -> None:
        if self._engine is not None and self._engine_live:
            self._engine_live = False
            try:
                self._engine.teardown()
            except Exception as error:  # noqa: BLE001  (exiting: report, never mask the exit status)
                log.error("ShardStrategy: engine teardown at exit failed: %r", error)
        super()._release_at_exit()
