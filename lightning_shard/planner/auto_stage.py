"""``ShardStrategy(stage="auto")``: run the planner on the real model, batch, precision and memory.

Picks the lowest stage (then the least recomputation) whose planned per-device bytes fit the
device memory with a safety margin, among the stages the strategy accepts with the flags it was
built with: offload flags stay as the user set them, and the engine they chose (fixed when the
strategy was built) keeps its rules (DeepSpeed: no fp16 at stage 0). The mesh is the strategy's
own (``tensor_parallel_size`` and ``pipeline_parallel_size`` divide the model, ``replicate_size`` > 1
is HSDP: stages 2-3 only, state sharded over one shard group). The choice and the table behind it are logged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_shard._batch import batch_shape as batch_shape_of
from lightning_shard.activation_checkpointing import ActivationCheckpointingConfig
from lightning_shard.planner.device import available_device_memory
from lightning_shard.planner.search import choose_stage
from lightning_shard.units import parse_size

log = logging.getLogger(__name__)


def batch_shape(trainer: Any) -> tuple[int | None, int | None]:
    """(micro-batch, sequence length) from the first batch of the training data, if it has tokens."""
    try:
        source = trainer.fit_loop._data_source
        dataloader = source.dataloader() if source.is_defined() else None
        batch = next(iter(dataloader)) if dataloader is not None else None
    except (StopIteration, TypeError, AttributeError):
        return None, None
    if batch is None:
        return None, None
    samples, tokens = batch_shape_of(batch)
    return samples, (tokens // samples if tokens else None)


def choose(
    module: nn.Module,
    trainer: Any,
    device: torch.device,
    world_size: int,
    local_world_size: int,
    precision: str,
    device_memory: int | str | None,
    activation_checkpointing: Any,
    offload_optimizer: Any,
    offload_params: Any,
    engine: str = "auto",
    nvme_path: str | None = None,
    tensor_parallel_size: int = 1,
    replicate_size: int = 1,
    pipeline_parallel_size: int = 1,
    microbatches: int = 1,
    context_parallel_size: int = 1,
    context_parallel_method: str = "allgather",
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
    expert_parallel_size: int = 1,
) -> tuple[int, str | None]:
    """Return (stage, activation checkpointing policy or None) for ``stage="auto"``.

    The mesh sizes are the strategy's, planned as fixed: with ``replicate_size > 1`` (HSDP) only
    stages 2 and 3 are candidates. With ``context_parallel_size`` = c the first batch's sequence (read
    before the strategy cuts it) is planned as ``seq_len / c`` tokens per rank plus what the method's
    attention keeps of the whole. ``tiled_mlp`` / ``tiled_loss``: the strategy's tiling, planned as such;
    ``expert_parallel_size``: the strategy's experts per rank, planned at every stage.
    """
    memory = (
        parse_size(device_memory, "ShardStrategy(device_memory)")
        if device_memory is not None
        else available_device_memory(device, local_world_size)
    )
    micro_batch, seq_len = batch_shape(trainer)
    if micro_batch is not None and pipeline_parallel_size > 1:
        # A pipeline runs its batch as microbatches; 1F1B keeps about p of them, each through 1/p of
        # the layers, in flight on its first stage: one microbatch's worth through all of them.
        micro_batch = -(-micro_batch // microbatches)
    plan = choose_stage(
        module,
        world_size,
        memory,
        precision,
        micro_batch,
        seq_len,
        activation_checkpointing=activation_checkpointing or "auto",
        offload_optimizer=offload_optimizer or "none",
        offload_params=offload_params or "none",
        engine=engine,
        nvme_path=nvme_path,
        tensor_parallel_size=tensor_parallel_size,
        replicate_size=replicate_size,
        pipeline_parallel_size=pipeline_parallel_size,
        micro_batches=microbatches if pipeline_parallel_size > 1 else None,
        context_parallel_size=context_parallel_size,
        context_parallel_method=context_parallel_method,
        tiled_mlp=tiled_mlp,
        tiled_loss=tiled_loss,
        expert_parallel_size=expert_parallel_size,
    )
    kwargs = plan.strategy_kwargs()
    stage = int(kwargs["stage"])
    policy = kwargs.get("activation_checkpointing")
    choice = f"ShardStrategy(stage='auto') chose stage={stage}" + (
        f", activation_checkpointing={policy!r}" if policy else ""
    )
    rank_zero_info(f"{choice} for {memory / 2**30:.2f} GiB per device:\n{plan.table()}")
    if not plan.fits:
        rank_zero_warn(
            f"{choice}, but even that is planned not to fit in {memory / 2**30:.2f} GiB per device."
        )
    return stage, (policy if activation_checkpointing is None else None)


def choose_for(strategy: Any, trainer: Any) -> tuple[int, Any]:
    """Resolve ``stage="auto"`` for ``strategy``: (stage, activation-checkpointing config, chosen if left open)."""
    config = strategy.config
    checkpointing = config.activation_checkpointing
    stage, chosen_policy = choose(
        strategy.lightning_module,
        trainer,
        strategy.root_device,
        strategy.world_size,
        strategy.num_processes,
        strategy.precision_plugin.precision,
        config.device_memory,
        checkpointing.policy if checkpointing is not None else None,
        config.offload_optimizer,
        config.offload_params,
        engine=config.engine,
        nvme_path=config.nvme_path,
        tensor_parallel_size=config.tensor_parallel_size,
        replicate_size=config.replicate_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        microbatches=config.microbatches,
        context_parallel_size=config.context_parallel_size,
        context_parallel_method=config.context_parallel_method,
        tiled_mlp=config.tiled_mlp is not False,
        tiled_loss=config.tiled_loss is not False,
        expert_parallel_size=config.expert_parallel_size,
    )
    if chosen_policy is not None:
        checkpointing = ActivationCheckpointingConfig.from_flag(chosen_policy)
    return stage, checkpointing
