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
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_shard import offload
from lightning_shard.checkpoint import DEEPSPEED_TAG
from lightning_shard.precision import ShardPrecision

log = logging.getLogger(__name__)
TAG = DEEPSPEED_TAG
_STALE_LOCK_SECONDS = 30 * 60
_COMM_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class DeepSpeedEngine:
    """Builds the DeepSpeed config from ShardStrategy's flags and drives ``DeepSpeedEngine``."""

    def __init__(
        self,
        stage: int,
        precision: ShardPrecision,
        offload_optimizer: str | None = None,
        offload_params: str | None = None,
        nvme_path: str | None = None,
        pin_memory: bool | None = None,
        rank: int = 0,
    ) -> None:
        if precision.precision == "bf16-true":
            raise ValueError(
                "ShardStrategy(engine='deepspeed') cannot run precision='bf16-true': DeepSpeed always keeps fp32 master"
                " weights. Use 'bf16-mixed', or engine='fsdp' for bf16-true."
            )
        if precision.precision == "16-mixed" and stage == 0:
            # DeepSpeed's fp16 optimizer without ZeRO divides every gradient by the loss scale in step(),
            # but engine.backward() only scales the loss for ZeRO optimizers: each update comes out
            # 65536x too small and the weights never move (DeepSpeed 0.19; deepspeedai/DeepSpeed#8393).
            raise ValueError(
                "ShardStrategy(stage=0, engine='deepspeed') cannot run precision='16-mixed': without ZeRO,"
                " DeepSpeed unscales fp16 gradients that its backward never scaled, so training stalls."
                " Use stage=1 or higher, precision='bf16-mixed', or engine='fsdp' for stage 0."
            )
        if precision.reduce_dtype is not None and precision.reduce_dtype not in _COMM_DTYPES:
            raise ValueError(
                f"ShardPrecision(reduce_dtype={precision.reduce_dtype}) is not available with engine='deepspeed',"
                " which reduces gradients in torch.float32, torch.bfloat16 or torch.float16. Use one of those."
            )
        self.stage = stage
        self.precision = precision
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.nvme_path = nvme_path
        self.pin_memory = pin_memory
        self.rank = rank
        self._backwards = 0  # backward calls since the last optimizer step

    # --- set-up ----------------------------------------------------------------------------------

    def config(
        self, accumulate: int, clip_val: float | None, clip_algorithm: str | None, device: torch.device
    ) -> dict:
        if clip_val and clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"Trainer(gradient_clip_algorithm={clip_algorithm!r}) is not available with engine='deepspeed',"
                " which clips by norm only. Use gradient_clip_algorithm='norm'."
            )
        zero: dict[str, Any] = {"stage": self.stage}
        pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
        for flag, key in (
            (self.offload_optimizer, "offload_optimizer"),
            (self.offload_params, "offload_param"),
        ):
            if flag is not None:
                zero[key] = {"device": flag, "pin_memory": pin}
                if flag == "nvme":
                    assert self.nvme_path is not None
                    zero[key]["nvme_path"] = str(offload.swap_dir(self.nvme_path, self.rank))
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": accumulate,
            "gradient_clipping": float(clip_val or 0.0),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        if self.precision.precision == "bf16-mixed":
            config["bf16"] = {"enabled": True}
        elif self.precision.precision == "16-mixed":
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        reduce_dtype = self.precision.reduce_dtype or (torch.float32 if self.precision.is_mixed else None)
        if reduce_dtype is not None:
            config["communication_data_type"] = _COMM_DTYPES[reduce_dtype]
        if "nvme" in (self.offload_optimizer, self.offload_params):
            config["aio"] = {
                "block_size": 1 << 20,
                "queue_depth": 8,
                "single_submit": False,
                "overlap_events": True,
            }
        return config

    def _swap_bytes(self, module: nn.Module, world_size: int) -> int:
        """This rank's bytes on NVMe: fp32 master + two Adam moments (12 B/param), fp32 parameters (4 B)."""
        numel = sum(p.numel() for p in module.parameters()) / max(world_size, 1)
        per_param = (12 if self.offload_optimizer == "nvme" else 0) + (
            4 if self.offload_params == "nvme" else 0
        )
        return int(numel * per_param)

    def initialize(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: dict,
        process_backend: str,
        world_size: int = 1,
    ) -> tuple:
        import deepspeed

        if len(optimizers) != 1:
            raise ValueError(
                f"ShardStrategy(engine='deepspeed') trains with exactly one optimizer; configure_optimizers returned"
                f" {len(optimizers)}. Return one optimizer (with param groups), or use engine='fsdp'."
            )
        if "nvme" in (self.offload_optimizer, self.offload_params):
            assert self.nvme_path is not None
            offload.clear_swap(self.nvme_path, self.rank, remove_parent=False)  # a crashed run's leftovers
            offload.check_nvme_path(self.nvme_path, self._swap_bytes(module, world_size))
            offload.swap_dir(self.nvme_path, self.rank).mkdir(parents=True, exist_ok=True)
        deepspeed.init_distributed(dist_backend=process_backend, auto_mpi_discovery=False, verbose=False)
        optimizer = self._offload_optimizer(optimizers[0])
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        return engine, ds_optimizer, optimizer

    def _offload_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.offload_optimizer is None or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return optimizer
        clear_stale_build_locks()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        defaults = optimizer.defaults
        if defaults.get("amsgrad"):
            raise ValueError("DeepSpeedCPUAdam has no amsgrad. Use amsgrad=False with offload_optimizer.")
        groups = [dict(group) for group in optimizer.param_groups]
        return DeepSpeedCPUAdam(
            groups,
            lr=defaults["lr"],
            betas=defaults["betas"],
            eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            adamw_mode=isinstance(optimizer, torch.optim.AdamW),
        )

    # --- training --------------------------------------------------------------------------------

    def backward(self, engine: Any, loss: torch.Tensor, manual: bool = False) -> None:
        self._backwards += 1
        if manual and self._backwards > 1 and self.stage in (1, 2):
            # ZeRO-1/2 reduce and partition gradients at every backward that DeepSpeed takes for an
            # accumulation boundary; with manual optimization it cannot know which one is, and a second
            # backward before step() would replace the first one's gradients instead of adding to them.
            raise ValueError(
                f"ShardStrategy(stage={self.stage}, engine='deepspeed') cannot accumulate gradients over several"
                " self.manual_backward() calls before optimizer.step(): DeepSpeed ZeRO-1/2 would keep only the"
                " last one. Call step() after every manual_backward(), use stage=0 or 3, or engine='fsdp'."
            )
        # Lightning's loop has already divided the loss by accumulate_grad_batches; DeepSpeed would
        # divide it again by gradient_accumulation_steps (the same number) and halve every gradient.
        engine.backward(loss, scale_wrt_gas=False)

    def step(self, engine: Any) -> None:
        self._backwards = 0
        engine.step()

    # --- checkpoints -----------------------------------------------------------------------------

    @staticmethod
    def save(engine: Any, tmp: Path, client_state: dict[str, Any]) -> None:
        engine.save_checkpoint(str(tmp), tag=TAG, client_state=client_state)

    @staticmethod
    def save_committed(
        engine: Any, path: Path, checkpoint: dict[str, Any], is_rank0: bool, barrier: Any
    ) -> None:
        """DeepSpeed's per-rank checkpoint, written under ``NAME.tmp`` and renamed once every rank is done."""
        from lightning_shard import checkpoint as ckpt

        checkpoint.pop("state_dict", None)  # DeepSpeed writes model and optimizer state itself
        checkpoint.pop("optimizer_states", None)
        tmp = path.with_name(path.name + ckpt.TMP_SUFFIX)
        if is_rank0:
            ckpt.remove(tmp)
        barrier()
        engine.save_checkpoint(str(tmp), tag=TAG, client_state=checkpoint)
        barrier()
        if is_rank0:
            ckpt.commit(tmp, path)
        barrier()

    @staticmethod
    def load(engine: Any, path: Path) -> dict[str, Any]:
        load_path, client_state = engine.load_checkpoint(str(path), tag=TAG, load_lr_scheduler_states=False)
        if load_path is None:
            raise ValueError(f"DeepSpeed found no checkpoint under {str(path)!r} (tag {TAG!r}).")
        return client_state

    # --- accounting ------------------------------------------------------------------------------

    def state_bytes(self, engine: Any) -> dict[str, dict[str, int]]:
        """Bytes of parameters and optimizer state this rank holds, by where they live."""
        where: dict[str, dict[str, int]] = {
            "parameters": {"accelerator": 0, "host": 0, "nvme": 0},
            "optimizer": {"accelerator": 0, "host": 0, "nvme": 0},
        }
        for p in engine.module.parameters():
            local = getattr(p, "ds_tensor", p)
            _add(where["parameters"], local)
        ds_optimizer = engine.optimizer
        masters = getattr(ds_optimizer, "single_partition_of_fp32_groups", None) or getattr(
            ds_optimizer, "fp32_partitioned_groups_flat", []
        )
        for tensor in masters:
            _add(where["optimizer"], tensor)
        inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
        for state in inner.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    _add(where["optimizer"], value)
        if self.nvme_path is not None:
            swapped = sum(
                f.stat().st_size
                for f in offload.swap_dir(self.nvme_path, self.rank).rglob("*")
                if f.is_file()
            )
            key = "optimizer" if self.offload_optimizer == "nvme" else "parameters"
            where[key]["nvme"] = swapped
        return where

    def teardown(self) -> None:
        if self.nvme_path is not None:
            offload.clear_swap(self.nvme_path, self.rank)


def _add(bucket: dict[str, int], tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    bucket["host" if tensor.device.type == "cpu" else "accelerator"] += nbytes


def clear_stale_build_locks(max_age_s: float = _STALE_LOCK_SECONDS) -> list[Path]:
    """Remove JIT-build ``lock`` files left by a killed build; otherwise every later build waits forever.

    torch's build lock records no owner, so age is the test: a build of DeepSpeed's ops takes minutes,
    a lock older than ``max_age_s`` belongs to a build that died.
    """
    from torch.utils.cpp_extension import _get_build_directory

    try:
        root = Path(_get_build_directory("", verbose=False)).parent
    except Exception:  # noqa: BLE001  (no build directory yet: nothing to clear)
        return []
    removed = []
    for lock in root.rglob("lock"):
        if time.time() - lock.stat().st_mtime > max_age_s:
            log.warning("Removing stale extension build lock %s (a killed build left it).", lock)
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def setup_deepspeed(strategy: Any, trainer: Any) -> DeepSpeedEngine:
    """ShardStrategy.setup for the DeepSpeed engine: optimizers from the module, then ``deepspeed.initialize``."""
    from lightning.pytorch.strategies.parallel import ParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_shard._optim import rebind_scheduler

    strategy.precision_plugin.engine_managed = True
    strategy.precision_plugin.engine_clip_val = trainer.gradient_clip_val
    ds = DeepSpeedEngine(
        strategy.stage,
        strategy.precision_plugin,
        strategy.offload_optimizer,
        strategy.offload_params,
        strategy.nvme_path,
        strategy.pin_memory,
        strategy.global_rank,
    )
    config = ds.config(
        trainer.accumulate_grad_batches,
        trainer.gradient_clip_val,
        trainer.gradient_clip_algorithm,
        strategy.root_device,
    )
    if trainer.state.fn != TrainerFn.FITTING:
        strategy.model.to(strategy.root_device)
        return ds
    strategy._reset_optimizers_and_schedulers()
    ParallelStrategy.setup_optimizers(strategy, trainer)  # the user's optimizer, on the unwrapped module
    engine, ds_optimizer, client_optimizer = ds.initialize(
        strategy.model, strategy.optimizers, config, strategy.process_group_backend, strategy.world_size
    )
    for scheduler_config in strategy.lr_scheduler_configs:
        if getattr(scheduler_config.scheduler, "optimizer", None) is not client_optimizer:
            rebind_scheduler(scheduler_config.scheduler, client_optimizer)
    strategy.model = engine
    strategy.optimizers = [ds_optimizer]
    return ds
