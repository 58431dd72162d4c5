"""The DeepSpeed engine: ZeRO 0-3 through ``deepspeed.initialize``, CPU-Adam, NVMe (ZeRO-Infinity) offload.

Chosen by ``ShardStrategy(engine="deepspeed")`` or, under ``engine="auto"``, by flags only DeepSpeed
serves (see :mod:`lightning_shard.offload`). It runs on CUDA (nccl) and on CPU (gloo, DeepSpeed's
CPU accelerator). The user's LightningModule and ``configure_optimizers`` are used as they are;
with optimizer offload, a torch ``Adam``/``AdamW`` is swapped for DeepSpeed's ``DeepSpeedCPUAdam``
with the same param groups and hyperparameters (a torch optimizer stepping on host memory is the
slow path DeepSpeed warns about).

Precision: ``32-true`` (no mixed precision), ``bf16-mixed`` (DeepSpeed ``bf16``: bf16 weights for
compute, fp32 master weights in the optimizer), ``16-mixed`` (DeepSpeed ``fp16`` with dynamic loss
scaling, all ranks agreeing on overflow; ZeRO stage 1 or higher). In mixed modes gradients are
reduced across ranks in ``ShardPrecision.reduce_dtype`` (fp32 unless set), as with the FSDP engine:
DeepSpeed's own default would reduce them in bf16/fp16. Gradient clipping (norm) and accumulation are
done by DeepSpeed from the Trainer's flags. DeepSpeed ZeRO-2/3 reduce gradients on every micro-batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_shard._meta import has_meta, init_hook, materialize
from lightning_shard._optim import rebind_schedulers
from lightning_shard.checkpoint.storage import Location
from lightning_shard.engines._matrix_optimizers import check_own_distribution, needs_whole_matrices
from lightning_shard.engines.base import Engine, RunContext, StateBytes, TrainSettings, on_every_rank_init
from lightning_shard.engines.deepspeed import checkpoint as checkpoints
from lightning_shard.engines.deepspeed import experts, offload, tensor_parallel
from lightning_shard.engines.deepspeed import whole_matrix as matrices
from lightning_shard.engines.deepspeed.capabilities import DEEPSPEED
from lightning_shard.engines.deepspeed.config import ds_config
from lightning_shard.engines.deepspeed.ops import cpu_adam
from lightning_shard.engines.deepspeed.precision import (
    DeepSpeedPrecision,
    check_device_precision,
    check_precision,
)
from lightning_shard.engines.deepspeed.weights import load_partitioned, rebind_partitioned

log = logging.getLogger(__name__)
#: Set on a module once this engine has set it up (a later Trainer call finds it partitioned by the fit).
_SET_UP = "_lightning_shard_deepspeed_set_up"


class DeepSpeedEngine(Engine):
    """Builds the DeepSpeed config from ShardStrategy's flags and drives ``deepspeed.initialize``'s engine."""

    capabilities = DEEPSPEED  # what it serves: engines/deepspeed/capabilities.py
    owns_step = capabilities.owns_step
    precision_class = DeepSpeedPrecision

    @classmethod
    def check_precision(cls, stage: int | str, precision: Any) -> None:
        check_precision(stage, precision)

    @classmethod
    def construction_context(cls, config: Any, precision: Any) -> Any:
        if config.stage != 3:  # "auto" is resolved only at set-up, after configure_model
            return super().construction_context(config, precision)
        # ZeRO-3: DeepSpeed's partitioned construction, each parameter partitioned as it is created.
        import deepspeed  # optional: DeepSpeed

        deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False)
        ds_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        if precision.precision == "bf16-mixed":
            ds_config["bf16"] = {"enabled": True}
        elif precision.precision == "16-mixed":
            ds_config["fp16"] = {"enabled": True}
        return deepspeed.zero.Init(config_dict_or_path=ds_config)

    def __init__(self, config: Any, precision: Any, run: RunContext) -> None:
        super().__init__(config, precision, run)
        check_precision(self.stage, precision)
        check_device_precision(run.device, precision)
        # ZeRO-3 gathers each block in its own hook: compiled blocks are DeepSpeed leaves (one graph per block).
        self.compiles_zero3_leaves = self.stage == 3
        self._backwards = 0  # backward calls since the last optimizer step
        self._expert_groups: experts.ExpertGroups | None = None  # expert parallelism's param groups
        self.async_writer = checkpoints.async_writer(config, run)  # async_checkpoint=True

    # --- set-up ----------------------------------------------------------------------------------

    def check_module(self, module: nn.Module) -> None:
        if has_meta(module) and self.stage == 3:
            raise ValueError(
                f"{type(module).__name__} was built on the meta device, which ShardStrategy(engine='deepspeed',"
                " stage=3) cannot shard: DeepSpeed partitions parameters it can read. Use engine='fsdp' (the"
                " default), which shards the meta model and allocates only each rank's shard; or build the"
                " model normally (DeepSpeed stages 0-2 keep a full copy per rank anyway)."
            )

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Allocation from meta and the device; DeepSpeed wraps the module together with its optimizer
        (:meth:`setup_optimizers`). Evaluation outside fit runs the module as it is, on the device, under the
        precision policy's autocast."""
        if has_meta(module):
            # Stages 0-2 replicate parameters: each rank allocates and initialises the whole model.
            materialize(module, self.run.device, self.run.global_rank, self.config.init_weights)
        partitioned = any(hasattr(p, "ds_tensor") for p in module.parameters())
        if init_hook(module) is not None and partitioned and not getattr(module, _SET_UP, False):
            # Partitioned before its first set-up: built under zero.Init (a later call finds the fit's partitions).
            log.warning(
                "ShardStrategy(engine='deepspeed', stage=3): %s.init_weights() is not run: configure_model built"
                " the model under deepspeed.zero.Init, where each module is initialised by its own constructor"
                " before it is partitioned. Use engine='fsdp' to have init_weights() run on the allocated shards.",
                type(module).__name__,
            )
        setattr(module, _SET_UP, True)
        if experts.has_experts(module):  # the expert blocks as DeepSpeed MoE parameters
            experts.make_local(module)
        if any(hasattr(p, "ds_process_group") for p in module.parameters()):
            import deepspeed  # optional: DeepSpeed

            deepspeed.init_distributed(dist_backend=self.run.backend, auto_mpi_discovery=False, verbose=False)
            rebind_partitioned(module)
        return module.to(self.run.device)

    def setup_optimizers(
        self, model: nn.Module, optimizers: list[Optimizer], schedulers: list[Any], settings: TrainSettings
    ) -> tuple[nn.Module, list[Optimizer]]:
        whole = self.stage >= 1 and any(
            needs_whole_matrices(optimizer, self.config.matrix_optimizer) for optimizer in optimizers
        )
        for optimizer in optimizers:
            check_own_distribution(optimizer, self.stage)
        if whole and experts.has_experts(model):
            raise ValueError(
                f"ShardStrategy(engine='deepspeed', stage={self.stage}, expert_parallel_size=...) cannot step"
                f" {type(optimizers[0]).__name__}, whose update needs whole matrices: DeepSpeed reduces and"
                " partitions each expert block over its own group, which the whole-matrix step does not follow."
                " Use engine='fsdp', which steps whole matrices with expert parallelism (docs/optimizers.md)."
            )
        config = self.ds_config(settings)
        engine, ds_optimizer, client_optimizer = self._initialize(model, optimizers, config)
        if whole:  # the user's optimizer on whole matrices, over ZeRO's partitions
            matrices.step_whole_matrices(engine, torch.device(self.run.device))
        # Schedulers follow the optimizer DeepSpeed steps (CPU-Adam when the optimizer is offloaded).
        rebind_schedulers(schedulers, optimizers, [client_optimizer])
        if isinstance(self.precision, DeepSpeedPrecision):
            self.precision.engine_started(settings.gradient_clip_val)
        return engine, [ds_optimizer]

    def ds_config(self, settings: TrainSettings) -> dict:
        """DeepSpeed's JSON config for these flags and the Trainer's accumulation and clipping."""
        return ds_config(self.config, self.precision, self.run, self.stage, settings)

    def _initialize(self, module: nn.Module, optimizers: list[Optimizer], config: dict) -> tuple:
        import deepspeed  # optional: DeepSpeed

        if len(optimizers) != 1:
            raise ValueError(
                f"ShardStrategy(engine='deepspeed') trains with exactly one optimizer; configure_optimizers returned"
                f" {len(optimizers)}. Return one optimizer (with param groups), or use engine='fsdp'."
            )
        offload.prepare_swap(self.config, module, self.run)
        deepspeed.init_distributed(dist_backend=self.run.backend, auto_mpi_discovery=False, verbose=False)
        optimizer = optimizers[0]
        self._expert_groups = experts.optimizer_groups(module, optimizer, self.run)
        if self._expert_groups is not None:
            optimizer = self._expert_groups.optimizer
        optimizer = cpu_adam(optimizer, self.config.offload_optimizer)
        if self._expert_groups is not None:
            engine, ds_optimizer = experts.initialize(module, optimizer, config)
            return engine, ds_optimizer, optimizer
        # No mpu: DeepSpeed's data-parallel group is the world, context-parallel ranks among it, so its mean
        # of the gradients undoes the weight the strategy gave each rank's loss (docs/context_parallel.md).
        # DeepSpeed's own sequence parallelism (an mpu with a sequence group) would sum over those ranks.
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        if self.run.dims.tp_enabled:  # AutoTP split the layers inside initialize
            tensor_parallel.check_split(engine, self.run.dims.tp)
            tensor_parallel.check_groups(self.run)
            tensor_parallel.guard_inputs(engine, self.run)
        return engine, ds_optimizer, optimizer

    # --- training --------------------------------------------------------------------------------

    def backward(self, model: nn.Module, loss: torch.Tensor, manual: bool) -> None:
        self._backwards += 1
        if manual and self._backwards > 1 and self.stage in (1, 2):
            # ZeRO-1/2 reduce and partition gradients at every backward that DeepSpeed takes for an
            # accumulation boundary; with manual optimization it cannot know which one is, and a second
            # backward before step() would replace the first one's gradients instead of adding to them.
            raise ValueError(
                f"ShardStrategy(stage={self.stage}, engine='deepspeed') cannot accumulate gradients over several"
                " backward calls (self.manual_backward() in manual optimization, fabric.backward() in a Fabric"
                " loop) before optimizer.step(): DeepSpeed ZeRO-1/2 would keep only the last one. Call step()"
                " after every backward, use stage=0 or 3, or engine='fsdp'."
            )
        # Lightning's loop has already divided the loss by accumulate_grad_batches; DeepSpeed would
        # divide it again by gradient_accumulation_steps (the same number) and halve every gradient.
        model.backward(loss, scale_wrt_gas=False)  # type: ignore[operator]

    def step(self, model: nn.Module, optimizer: Optimizer) -> None:
        self._backwards = 0
        if self._expert_groups is not None:
            self._expert_groups.follow()
        model.step()  # type: ignore[operator]

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        model: nn.Module,
        optimizers: list[Optimizer],
        checkpoint: dict[str, Any],
        path: Location,
        exception: bool = False,
    ) -> None:
        split = self._expert_groups is not None
        checkpoints.save(model, checkpoint, path, self.run, split, self.async_writer)

    def load_checkpoint(
        self, model: nn.Module, optimizers: list[Optimizer], path: Location, weights_only: bool | None = None
    ) -> dict[str, Any]:
        mixed, split = self.precision.is_mixed, self._expert_groups is not None
        return checkpoints.load(model, path, weights_only, self.run, mixed, split, self.async_writer)

    def remove_checkpoint(self, path: Location) -> None:
        if self.async_writer is not None and isinstance(path, Path):
            self.async_writer.remove(path)  # deferred while a save is pending
        else:
            super().remove_checkpoint(path)

    def wait_for_checkpoints(self) -> None:
        if self.async_writer is not None:
            self.async_writer.wait()

    def model_state_dict(self, model: nn.Module, full: bool) -> dict[str, Any]:
        return {}  # DeepSpeed writes model and optimizer state itself, per rank

    def optimizer_state_dict(self, model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        return {}

    # --- accounting ------------------------------------------------------------------------------

    def state_bytes(self, model: nn.Module, optimizers: list[Optimizer]) -> StateBytes:
        held = StateBytes()
        module = getattr(model, "module", model)
        for p in module.parameters():
            held.add("parameters", getattr(p, "ds_tensor", p))
        ds_optimizer = getattr(model, "optimizer", None)
        if ds_optimizer is None:  # not trained yet (evaluation): nothing else is held
            return held
        masters = getattr(ds_optimizer, "single_partition_of_fp32_groups", None) or getattr(
            ds_optimizer, "fp32_partitioned_groups_flat", []
        )
        for tensor in masters:
            held.add("optimizer", tensor)
        inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
        whole = matrices.whole_matrix_step(model)
        owned = [] if whole is None else whole.state_tensors()
        for value in [v for state in inner.state.values() for v in state.values()] + owned:
            if torch.is_tensor(value) and value.dim() > 0:
                held.add("optimizer", value)
        swapped = offload.swapped(self.config, self.run)
        if swapped is not None:
            kind, nbytes = swapped
            held.held[kind]["nvme"] = nbytes
        return held

    def teardown(self) -> None:
        try:
            if self.async_writer is not None:
                self.async_writer.close()
        finally:
            offload.clear(self.config, self.run)
            if self.run.dims.tp > 1:
                tensor_parallel.release()

    def load_full_weights(self, module: nn.Module, path: str) -> None:
        if not any(hasattr(p, "ds_tensor") for p in module.parameters()):
            with experts.blocks_as_dtensors(module):  # expert parallelism: each rank reads its experts' rows
                super().load_full_weights(module, path)  # whole parameters: each rank reads what it holds
            return
        on_every_rank_init(path, lambda: load_partitioned(module, path, self.run.is_global_zero))

    @classmethod
    def destroy_world(cls) -> None:
        # Through deepspeed.comm when DeepSpeed started: it also drops its cached groups, so the next
        # Trainer call's deepspeed.initialize makes them again on the new default group.
        import deepspeed.comm as ds_comm  # optional: DeepSpeed

        if ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            super().destroy_world()
