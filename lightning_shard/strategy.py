"""ShardStrategy: ZeRO stages 0-3 for any LightningModule, on CPU (gloo) and CUDA (nccl).

The strategy owns the process group and the device mesh, validates flags before any process
starts, and delegates sharding, state dicts and gradient sync to one engine
(:mod:`lightning_shard.engines`). Checkpoints go through :mod:`lightning_shard.checkpoint`.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard import _auto_stage, _flags
from lightning_shard import checkpoint as ckpt
from lightning_shard._modules import ModuleClassSpec, resolve_module_classes
from lightning_shard._optim import rebind_scheduler
from lightning_shard.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from lightning_shard.async_checkpoint import AsyncCheckpointer, new_checkpoint_group
from lightning_shard.engines.deepspeed import DeepSpeedEngine, setup_deepspeed
from lightning_shard.engines.fsdp import FSDPEngine
from lightning_shard.memory import model_state_bytes
from lightning_shard.nonfinite import NonFiniteGuard
from lightning_shard.offload import OffloadDevice
from lightning_shard.precision import ShardPrecision, to_shard_precision

log = logging.getLogger(__name__)

Engine = Literal["auto", "fsdp", "deepspeed"]
CheckpointMode = Literal["sharded", "full"]


class ShardStrategy(ParallelStrategy):
    """Train any LightningModule with ZeRO-style sharding, chosen by flag.

    ==========  =====================  ====================  ======================
    ``stage``   optimizer state / rank  gradients / rank      parameters / rank
    ==========  =====================  ====================  ======================
    0           K·Ψ                     2·Ψ (fp16) or 4·Ψ     all
    1           K·Ψ / N                 all                   all
    2           K·Ψ / N                 Ψ / N                 all in fwd+bwd
    3           K·Ψ / N                 Ψ / N                 Ψ / N
    ==========  =====================  ====================  ======================

    (Ψ parameters, N ranks, K bytes of optimizer state per parameter, e.g. 8 for fp32 Adam.)

    Args:
        stage: ZeRO stage, 0 (replicated, DDP) to 3 (parameters, gradients and optimizer state sharded).
        engine: ``"auto"`` (FSDP2), ``"fsdp"``, or ``"deepspeed"``.
        shard_modules: module classes (or import-path strings) that become sharding units at stages 2-3;
            ``None`` detects the model's repeated block class.
        checkpoint: ``"sharded"`` (each rank writes its shard, a directory) or ``"full"`` (one file).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default gloo on CPU and nccl on CUDA.
        timeout: process-group timeout.
        offload_optimizer: ``"cpu"`` or ``"nvme"``: keep optimizer state (and its step) off the accelerator.
        offload_params: ``"cpu"`` or ``"nvme"`` (stage 3): keep parameter shards off the accelerator.
        nvme_path: directory on an NVMe drive for ``"nvme"`` offload; swap files live in a subdirectory
            of it and are removed at teardown.
        pin_memory: pin host buffers for offload (default: on CUDA).
        activation_checkpointing: ``"full"``, ``"selective"`` or an :class:`ActivationCheckpointing` config;
            the repeated blocks are checkpointed before they are sharded (same implementation as the callback).
        device_memory: with ``stage="auto"``, the per-device memory to plan for (bytes or e.g. ``"16GB"``);
            default: free accelerator memory, or this rank's share of available RAM on CPU.
        async_checkpoint: write sharded checkpoints in the background (see :mod:`lightning_shard.async_checkpoint`).
        skip_nonfinite: skip, on every rank together, an optimizer step whose loss or gradients are NaN/inf
            on any rank.
        max_skipped: with ``skip_nonfinite``, consecutive skipped steps allowed before training stops.
    """

    strategy_name = "shard"

    def __init__(
        self,
        stage: int | Literal["auto"] = 3,
        engine: Engine = "auto",
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.stage, self.engine_name = _flags.validate(
            stage,
            engine,
            checkpoint,
            offload_optimizer,
            offload_params,
            nvme_path,
            device_memory,
            async_checkpoint,
            skip_nonfinite,
            max_skipped,
        )
        self.activation_checkpointing = ActivationCheckpointing.from_flag(
            activation_checkpointing, "ShardStrategy(activation_checkpointing=...)"
        )
        self.device_memory = device_memory
        self.offload_optimizer, self.offload_params = offload_optimizer, offload_params
        self.nvme_path, self.pin_memory = nvme_path, pin_memory
        self._ds: DeepSpeedEngine | None = None
        self.async_checkpoint = async_checkpoint
        self._async: AsyncCheckpointer | None = None
        self.skip_nonfinite = skip_nonfinite
        self._guard = NonFiniteGuard(max_skipped) if skip_nonfinite else None
        self._shard_modules = resolve_module_classes(shard_modules, "ShardStrategy(shard_modules=...)")
        self.checkpoint_mode: CheckpointMode = checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: Any = None
        self._engine: FSDPEngine | None = None
        self.num_nodes = 1
        # With manual optimization the backward runs inside the step, before DDP's forward returns:
        # this keeps DDP from arming its reducer a second time after the step (FSDP2 is unaffected).
        self._forward_redirection = _DDPForwardRedirection()

    # --- precision -------------------------------------------------------------------------------

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ShardPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardPrecision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from Trainer(precision=...): translate it here, at
        # Trainer construction, so an unsupported precision fails before any process starts.
        self._precision_plugin = None if plugin is None else to_shard_precision(plugin)

    # --- processes and devices -------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def _lm(self) -> L.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def _stage(self) -> int:
        # stage="auto" is resolved at the start of setup(); everything after it sees an int.
        assert isinstance(self.stage, int), "ShardStrategy.stage is still 'auto' before setup()"
        return self.stage

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError("ShardStrategy.device_mesh is only available once processes have started.")
        return self._device_mesh

    @property
    def engine(self) -> FSDPEngine:
        if self._engine is None:
            raise RuntimeError(
                "ShardStrategy.engine is only available once the Trainer has set the model up."
            )
        return self._engine

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: a custom strategy must say so to get a DistributedSampler.
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(
            self.root_device.type, (self.world_size,), mesh_dim_names=("dp",)
        )
        if self.async_checkpoint and (self._async is None or self._async.closed):
            self._async = AsyncCheckpointer(self.is_global_zero, new_checkpoint_group())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # --- model and optimizers --------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.stage == "auto":
            _auto_stage.apply(self, trainer)
        if self.activation_checkpointing is not None:
            apply_activation_checkpointing(self._lm, self.activation_checkpointing)
        if self.engine_name == "deepspeed":
            self._ds = setup_deepspeed(self, trainer)
            return
        self.precision_plugin.setup_device(self.root_device, self.device_mesh.get_group())
        self._engine = FSDPEngine(
            self._stage,
            self.device_mesh,
            self.precision_plugin,
            self._shard_modules,
            cpu_offload=self.offload_params == "cpu",
            pin_memory=self.pin_memory,
        )
        module = self.precision_plugin.convert_module(self.model)
        if self._stage < 2:
            module.to(self.root_device)
        self.model = self._engine.wrap(module)
        _materialize_distributed_module(self._lm, self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # DeepSpeed counts micro-batches itself and steps at the boundary.
        return self.engine_name == "deepspeed"

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.engine_name != "deepspeed":
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lm)
        assert self._ds is not None
        self._ds.backward(self.model, closure_loss, manual=not self._lm.automatic_optimization)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self._lm)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None and self.model is not None:
            self._engine.pre_backward(self.model, closure_loss, manual=not self._lm.automatic_optimization)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        # Re-made on every setup: the optimizer must hold the parameters of the module as now wrapped.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        originals = list(self.optimizers)
        assert self.model is not None
        wrapped = self.engine.wrap_optimizers(self.model, originals)
        for old, new in zip(originals, wrapped, strict=True):
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is old:
                    rebind_scheduler(config.scheduler, new)
        self.optimizers = wrapped

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # FSDP2's hooks sit on the root module's forward, but Lightning calls training_step:
        # route the step through forward so parameters are gathered and gradients reduced.
        module, model = self._lm, self.model
        assert model is not None
        if model is not module or self._stage >= 2:
            return self._forward_redirection(model, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.engine_name == "deepspeed":
            result = closure()
            self.precision_plugin._after_closure(self._lm, optimizer)
            assert self._ds is not None
            self._ds.step(self.model)
            return result
        if self._guard is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # With a loss scaler, inf gradients are the scaler's business (it backs off and skips).
        check_grads = self.precision_plugin.scaler is None
        if self._guard.should_skip(result, params, self.root_device, check_grads):
            optimizer.zero_grad(set_to_none=True)
            self._guard.report(self._lm.trainer, self.is_global_zero)
            return None
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def state_bytes(self) -> dict[str, Any]:
        """This rank's bytes of model state; with DeepSpeed, split by where they live (accelerator/host/nvme)."""
        if self._ds is not None:
            return self._ds.state_bytes(self.model)
        return model_state_bytes(self._lm, self.optimizers).as_dict()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because of non-finite values (``skip_nonfinite=True``)."""
        return self._guard.total if self._guard is not None else 0

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._engine is None or self.model is None:
            yield
            return
        with self._engine.no_sync(self.model):
            yield

    # --- collectives -----------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        if self._ds is not None:
            self._ds.teardown()
        if self._async is not None:
            self._async.close()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # --- checkpoints -----------------------------------------------------------------------------

    @property
    def _full(self) -> bool:
        return self.checkpoint_mode == "full"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._ds is not None:
            return {}  # DeepSpeed writes model and optimizer state itself, per rank
        assert self.model is not None
        return self.engine.model_state_dict(self.model, full=self._full)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._ds is not None:
            return {}
        assert self.model is not None
        return self.engine.optimizer_state_dict(self.model, optimizer, full=self._full)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint(), straight into the sharded layout

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "ShardStrategy.save_checkpoint(storage_options=...) is not supported: it writes with DCP."
            )
        path = Path(self.broadcast(str(filepath)))
        if self._ds is not None:
            DeepSpeedEngine.save_committed(self.model, path, checkpoint, self.is_global_zero, self.barrier)
            return
        if not self._full:
            state = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
            for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[ckpt.optimizer_key(i)] = opt_state
            if self._async is not None:
                self._async.save(state, checkpoint, path, self.barrier)
            else:
                ckpt.save_sharded(path, state, checkpoint, self.is_global_zero, self.barrier)
            return
        if self.is_global_zero:
            ckpt.save_file(checkpoint, path)
        self.barrier()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._async is not None:
            self._async.remove(Path(filepath))
        elif self.is_global_zero:
            ckpt.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._async is not None:
            self._async.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        if self._ds is not None:
            ckpt.check_deepspeed_checkpoint(path)
            return DeepSpeedEngine.load(self.model, path)
        if path.is_dir():
            return ckpt.load_sharded_into(self.engine, self.model, self.optimizers, path)
        return ckpt.load_full_into(self.engine, self.model, self.optimizers, path)
