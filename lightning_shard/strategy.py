"""ShardStrategy: ZeRO stages 0-3 for any LightningModule, on CPU (gloo) and CUDA (nccl).

The strategy validates flags before any process starts, builds one engine at set-up
(:mod:`lightning_shard.engines`) and delegates sharding, state dicts and gradient sync to it. Its other
jobs live in the modules named for them: processes, groups and collectives in
:mod:`lightning_shard._processes`, step hooks in :mod:`lightning_shard._steps`, checkpoint hooks in
:mod:`lightning_shard._checkpoint_hooks` (over :mod:`lightning_shard.checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_shard import _compat, _ddp
from lightning_shard._checkpoint_hooks import CheckpointHooks
from lightning_shard._lightning_compat_callbacks import adapt as adapt_lightning_callbacks
from lightning_shard._meta import parameters_on_meta
from lightning_shard._modules import ModuleClassSpec
from lightning_shard._pipeline_steps import PipelineSteps
from lightning_shard._preemption import Preemption
from lightning_shard._processes import CollectiveTimeoutError
from lightning_shard.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from lightning_shard.config import CheckpointMode, EngineFlag, ShardConfig
from lightning_shard.engines import Engine, RunContext, TrainSettings, engine_class
from lightning_shard.nonfinite import NonFiniteGuard
from lightning_shard.offload import OffloadDevice
from lightning_shard.parallel import clip_grad_norm_, data_parallel_mesh, tensor_parallel_mesh
from lightning_shard.pipeline import PipelineScheduleName
from lightning_shard.planner import auto_stage
from lightning_shard.precision import ShardPrecision, to_shard_precision

if TYPE_CHECKING:
    from lightning_shard.fabric import ShardFabricStrategy

log = logging.getLogger(__name__)
_compat.record_weights_only()  # fit(ckpt_path=..., weights_only=...) reaches load_checkpoint


class ShardStrategy(PipelineSteps, CheckpointHooks):
    """Train any LightningModule with ZeRO-style sharding, chosen by flag.

    What each stage shards, and the bytes per rank, are in the ZeRO table of docs/strategy.md
    ("Memory per rank"). The strategy validates its flags into one :class:`ShardConfig`, owns the
    processes and the device mesh, and hands everything else to one engine through the contract in
    :mod:`lightning_shard.engines.base`.

    Args:
        stage: ZeRO stage, 0 (replicated, DDP) to 3 (parameters, gradients and optimizer state sharded).
        engine: ``"auto"`` (chosen from the other flags) or an engine's name (see docs/architecture.md).
        shard_modules: module classes (or import-path strings) that become sharding units at stages 2-3;
            ``None`` detects the model's repeated block class.
        checkpoint: ``"sharded"`` (each rank writes its shard, a directory) or ``"full"`` (one file).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default gloo on CPU and nccl on CUDA.
        timeout: the longest any collective may wait, on every process group the strategy and its engine
            use (the device mesh's, the async checkpoint group, DeepSpeed's); past it the job ends with a
            :class:`~lightning_shard.CollectiveTimeoutError` naming this flag.
        offload_optimizer: ``"cpu"`` or ``"nvme"``: keep optimizer state (and its step) off the accelerator.
        offload_params: ``"cpu"`` or ``"nvme"`` (stage 3): keep parameter shards off the accelerator.
        nvme_path: directory on an NVMe drive for ``"nvme"`` offload; swap files live in a subdirectory
            of it and are removed at teardown.
        pin_memory: pin host buffers for offload (default: on CUDA).
        activation_checkpointing: ``"full"``, ``"selective"`` or an :class:`ActivationCheckpointing` config;
            the repeated blocks are checkpointed before they are sharded (same implementation as the callback).
        device_memory: with ``stage="auto"``, the per-device memory to plan for (bytes or e.g. ``"16GB"``);
            default: free accelerator memory, or this rank's share of available RAM on CPU.
        async_checkpoint: write sharded checkpoints in the background (see :mod:`lightning_shard.checkpoint.async_save`).
        skip_nonfinite: skip, on every rank together, an optimizer step whose loss or gradients are NaN/inf
            on any rank.
        max_skipped: with ``skip_nonfinite``, consecutive skipped steps allowed before training stops.
        init_weights: start from full weights: a ``torch.save`` state-dict file (``lightning-shard
            consolidate`` writes one), a ``.safetensors`` file, or a Hugging Face model directory. Loaded
            once per module, after it is sharded: each rank reads only the slices of its own shards.
        replicate_size: HSDP (stages 2-3): the data-parallel ranks form this many replica groups; each shards
            the model over its own ranks (one node's, say) and gradients are all-reduced across groups.
        tensor_parallel_size: split the layers named by the plan over this many ranks (the innermost mesh
            dimension: keep it within a node), before FSDP2 shards over the rest. The world is laid out as
            ``replicate_size x shard x tensor_parallel_size`` (docs/parallelism.md).
        tensor_parallel_plan: module-name pattern (``"blocks.*.attn.qkv"``) -> ``"colwise"``, ``"rowwise"``,
            ``"sequence"`` or a torch ``ParallelStyle``; ``None`` uses the plan the model carries (a
            ``tensor_parallel_plan`` attribute, or a Hugging Face ``config.base_model_tp_plan``).
        pipeline_parallel_size: cut the model into this many pipeline stages (the outermost mesh dimension:
            ``pp x replicate x shard x tp``); the LightningModule contract is in docs/pipeline.md.
        pipeline_schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zero_bubble"`` (torch's
            schedules; the last two run several stages on each rank).
        microbatches: pieces each batch is cut into along its first dimension (default 2 x stages).
        stages_per_rank: stages on each rank (interleaved schedules only; default 1, and 2 for them).
        pipeline_split_points: the blocks that start stages 2, 3, ... (``["model.blocks.2"]``); default:
            balanced by parameter count.
        compile: ``True`` or a dict of ``torch.compile`` options: compile each repeated block after tensor
            parallelism and activation checkpointing, before FSDP2 shards it (:mod:`lightning_shard.compile`).
        gradient_compression: stages 0-1: ``"bf16"``, ``"fp16"``, ``"powersgd"`` or ``{"method": "powersgd",
            "rank": r, "start_iter": n, ...}``, through DDP's communication hooks
            (:mod:`lightning_shard.compression`).
        **kwargs: Lightning's ``DDPStrategy`` options, stages 0-1 of the FSDP engine only
            (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, any other
            ``DistributedDataParallel`` argument, ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper``).

    Models larger than one device: build them under ``trainer.init_module(empty_init=True)`` or in
    ``configure_model``; their parameters stay on the meta device until set-up shards them and
    allocates each rank's part (see docs/large_models.md and :mod:`lightning_shard._meta`).
    """

    strategy_name = "shard"

    def __init__(
        self,
        stage: int | Literal["auto"] = 3,
        engine: EngineFlag = "auto",
        shard_modules: Iterable[ModuleClassSpec] | ModuleClassSpec | None = None,
        checkpoint: CheckpointMode = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        offload_optimizer: OffloadDevice | None = None,
        offload_params: OffloadDevice | None = None,
        nvme_path: str | None = None,
        pin_memory: bool | None = None,
        activation_checkpointing: Literal["full", "selective"] | ActivationCheckpointing | None = None,
        device_memory: int | str | None = None,
        async_checkpoint: bool = False,
        skip_nonfinite: bool = False,
        max_skipped: int = 10,
        init_weights: str | Path | None = None,
        replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, Any] | None = None,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: PipelineScheduleName = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        pipeline_split_points: list[str] | None = None,
        compile: bool | dict[str, Any] = False,
        gradient_compression: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs, ddp_kwargs = _ddp.split_kwargs(kwargs)
        self.config = ShardConfig.from_flags(
            stage=stage,
            engine=engine,
            shard_modules=shard_modules,
            checkpoint=checkpoint,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            nvme_path=nvme_path,
            pin_memory=pin_memory,
            activation_checkpointing=activation_checkpointing,
            device_memory=device_memory,
            async_checkpoint=async_checkpoint,
            skip_nonfinite=skip_nonfinite,
            max_skipped=max_skipped,
            process_group_backend=process_group_backend,
            timeout=timeout,
            init_weights=init_weights,
            replicate_size=replicate_size,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_plan=tensor_parallel_plan,
            ddp_kwargs=ddp_kwargs,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_schedule=pipeline_schedule,
            microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            pipeline_split_points=pipeline_split_points,
            compile=compile,
            gradient_compression=gradient_compression,
        )
        # Resolved once: the precision setter, the set-up and Lightning's per-batch accumulation check ask it.
        self._engine_class = engine_class(self.config.engine)
        super().__init__(
            self.config.process_group_backend,
            self.config.timeout,
            self.config.replicate_size,
            self.config.tensor_parallel_size,
            self.config.pipeline_parallel_size,
            **kwargs,
        )
        self._guard = NonFiniteGuard(max_skipped) if skip_nonfinite else None
        self._engine: Engine | None = None
        self._engine_live = False
        self._checkpointed_module: L.LightningModule | None = None
        self._preemption = Preemption()
        self._weights_loaded_into: L.LightningModule | None = None
        self._empty_init = False  # init_module(empty_init=True) was used: configure_model builds empty too

    def fabric(self) -> ShardFabricStrategy:
        """The same flags as a Lightning Fabric strategy: ``L.Fabric(strategy=ShardStrategy(...).fabric())``."""
        from lightning_shard.fabric import ShardFabricStrategy

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
    def activation_checkpointing(self) -> ActivationCheckpointing | None:
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
            self._precision_plugin = self._engine_class.precision_class()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from Trainer(precision=...): translate it here, at
        # Trainer construction, so an unsupported precision fails before any process starts.
        if plugin is None:
            self._precision_plugin = None
            return
        precision = self._engine_class.precision_class.from_plugin(to_shard_precision(plugin))
        self._engine_class.check_precision(self.config.stage, precision)
        self._precision_plugin = precision

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
        with self._engine_class.construction_context(self.config, self.precision_plugin):
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
        if self.activation_checkpointing is not None and self._checkpointed_module is not self._lm:
            # Once per module: a later Trainer call (validate after fit, fit again) finds it patched. On the
            # whole model, before a pipeline stage keeps too few blocks to detect their class from.
            apply_activation_checkpointing(self._lm, self.activation_checkpointing)
            self._checkpointed_module = self._lm
        self._cut_to_stage()  # pipeline stages: this rank keeps its own before anything shards it
        self.precision_plugin.setup_device(self.root_device, None)  # the loss scaler agrees over every rank
        if self.layout.multi_dimensional:
            # Parameters on two meshes ((dp, tp) and dp), or on pipeline stages: one norm over all of them.
            self.precision_plugin.clip_grad_norm = partial(clip_grad_norm_, pipeline_stages=self.layout.pp)
        if self._engine is None or not self._engine_live:
            run = RunContext(
                device=self.root_device,
                mesh=data_parallel_mesh(self.device_mesh),
                tp_mesh=tensor_parallel_mesh(self.device_mesh),
                world_mesh=self.device_mesh,
                global_rank=self.global_rank,
                world_size=self.world_size,
                backend=str(self.process_group_backend),
                barrier=self.barrier,
            )
            self._engine = self._engine_class(self.config, self.precision_plugin, run)
            self._engine_live = True
        self.model = self._engine.setup_module(self.model)
        self._build_stage_runner()
        if self.config.init_weights is not None and self._weights_loaded_into is not self._lm:
            # Once per module: later Trainer calls (and checkpoint resumes) keep the trained weights.
            self._engine.load_full_weights(self._lm, self.config.init_weights)
            self._weights_loaded_into = self._lm
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.apply_timeout()  # groups the engine made (DeepSpeed's) get the timeout flag's limit too
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
        are destroyed at exit (:mod:`lightning_shard._processes`)."""
        try:
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
