"""The planner's figures for the flags of a dry run: parameters, gradients and optimizer state at each rank's place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_shard.config import ShardConfig
from lightning_shard.planner import plan


def planner_figures(
    module: nn.Module,
    config: ShardConfig,
    world_size: int,
    precision: str,
    batch: tuple[int, int] | None = None,
) -> Callable[[dict[str, int]], dict[str, int]]:
    """``plan(...)``'s model state at ``config``'s stage, mesh and offloads, for a rank's coordinates: the device's
    ``parameters``, ``gradients`` and ``optimizer``, and what the offloads keep on the ``host``, of the rank at
    that place (its pipeline stage and its index in the shard group), or the planner's worst rank's where it reads
    no tensors of the model. With ``batch`` (micro-batch, sequence length: a traced step's), also the planner's
    ``activations`` and ``buffers`` (its worst rank's) of one step of that batch, as :func:`step_figures` reads
    them."""
    result = plan(
        module=module,
        world_size=world_size,
        device_memory=2**62,  # whether it fits is not the question here
        precision=precision,
        stage=config.stage,  # type: ignore[arg-type]
        offload_optimizer=config.offload_optimizer or "none",
        offload_params=config.offload_params or "none",
        activation_checkpointing="none" if config.activation_checkpointing is None else "full",
        micro_batch=batch[0] if batch else None,
        seq_len=batch[1] if batch else None,
        engine=config.engine,
        tensor_parallel_size=config.tensor_parallel_size,
        replicate_size=config.replicate_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_parallel_size=config.expert_parallel_size,
        gpus_per_node=max(8, config.tensor_parallel_size),
    )
    row = result.stages[int(config.stage)]
    worst = {
        "parameters": row.parameters,
        "gradients": row.gradients,
        "optimizer": row.optimizer,
        "host": row.host,
    }

    def at(place: dict[str, int]) -> dict[str, int]:
        # the shard group's index: FSDP2 / ZeRO-1 shard over ``shard x cp`` (parallel.dims)
        index = place["shard"] * config.context_parallel_size + place["cp"]
        figures = dict(row.rank_figures(place["pp"], index) or worst)
        if batch is not None:
            figures.update(activations=row.activations, buffers=row.buffers)
        return figures

    return at
