"""DeepSpeed's JSON config from the flags (ZeRO stage, offload targets, NVMe's swap folders and I/O), the
precision policy (bf16 / fp16 and the gradients' reduction dtype), the tensor-parallel size (AutoTP) and the
Trainer's accumulation and clipping."""

from __future__ import annotations

from typing import Any

import torch

from lightning_shard import offload
from lightning_shard.config import ShardConfig
from lightning_shard.engines.base import RunContext, TrainSettings
from lightning_shard.engines.deepspeed import tensor_parallel
from lightning_shard.engines.deepspeed.precision import COMM_DTYPES


def ds_config(
    config: ShardConfig, precision: Any, run: RunContext, stage: int, settings: TrainSettings
) -> dict:
    """DeepSpeed's config for these flags and the Trainer's accumulation and clipping."""
    accumulate, clip_val = settings.accumulate_grad_batches, settings.gradient_clip_val
    clip_algorithm, device = settings.gradient_clip_algorithm, run.device
    if clip_val and clip_algorithm not in (None, "norm"):
        raise ValueError(
            f"Trainer(gradient_clip_algorithm={clip_algorithm!r}) is not available with engine='deepspeed',"
            " which clips by norm only. Use gradient_clip_algorithm='norm'."
        )
    zero: dict[str, Any] = {"stage": stage}
    pin = config.pin_memory if config.pin_memory is not None else device.type == "cuda"
    for flag, key in (
        (config.offload_optimizer, "offload_optimizer"),
        (config.offload_params, "offload_param"),
    ):
        if flag is not None:
            zero[key] = {"device": flag, "pin_memory": pin}
            if flag == "nvme":
                assert config.nvme_path is not None
                zero[key]["nvme_path"] = str(offload.swap_dir(config.nvme_path, run.global_rank))
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulate,
        "gradient_clipping": float(clip_val or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if run.dims.tp_enabled:  # DeepSpeed's AutoTP splits the layers inside deepspeed.initialize
        ds["tensor_parallel"] = tensor_parallel.config_section(run.dims.tp)
    if precision.precision == "bf16-mixed":
        ds["bf16"] = {"enabled": True}
    elif precision.precision == "16-mixed":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    reduce_dtype = precision.reduce_dtype or (torch.float32 if precision.is_mixed else None)
    if reduce_dtype is not None:
        ds["communication_data_type"] = COMM_DTYPES[reduce_dtype]
    if "nvme" in (config.offload_optimizer, config.offload_params):
        ds["aio"] = {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
        }
    return ds
