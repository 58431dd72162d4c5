"""The model's own numbers against the layout: what ``ParallelDims.for_world`` cannot see from the world size.

A layout can divide the world and still not split the model: tensor parallelism cuts every attention layer
into ``tensor_parallel_size`` slices of whole heads, expert parallelism gives each rank ``E / ep`` whole
experts, pipeline parallelism needs a block per stage. These checks run on the numbers the model declares
(read off a module built on the meta device), before any shard is allocated; each error names the flag as
the user typed it, its value, the model's number and the nearest sizes that divide both that number and
the ranks the flag splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_shard.parallel.dims import ParallelDims, strategy_flag


@dataclass(frozen=True)
class ModelSizes:
    """The numbers of a model that a layout must divide (``None``: the model does not say)."""

    heads: int | None = None
    """Attention (query) heads per layer: ``num_attention_heads``."""
    kv_heads: int | None = None
    """Key-value heads per layer (grouped-query attention): ``num_key_value_heads``."""
    experts: int | None = None
    """Experts per experts module (mixture of experts)."""
    layers: int | None = None
    """Repeated blocks: what the pipeline cuts into stages."""


def fitting_sizes(number: int, ranks: int) -> list[int]:
    """Sizes that divide both the model's ``number`` and the ``ranks`` the flag splits."""
    return [d for d in range(1, min(number, ranks) + 1) if number % d == 0 and ranks % d == 0]


def _nearest(value: int, fitting: list[int]) -> str:
    ordered = sorted(fitting, key=lambda d: (abs(d - value), -d))
    listed = ", ".join(map(str, fitting))
    return f"{listed}; nearest: {ordered[0]}" if fitting else "none"


def check_model_sizes(
    dims: ParallelDims,
    sizes: ModelSizes,
    stages_per_rank: int = 1,
    flag: Callable[[str, int], str] = strategy_flag,
    error: type[ValueError] = ValueError,
) -> None:
    """Raise ``error`` when the layout ``dims`` cannot split a model of ``sizes`` (see the module's docstring)."""
    stage_ranks = dims.world_size // dims.pp
    for number, what in (
        (sizes.heads, "attention heads (num_attention_heads)"),
        (sizes.kv_heads, "key-value heads (num_key_value_heads)"),
    ):
        if number and number % dims.tp:
            raise error(
                f"{flag('tensor_parallel_size', dims.tp)} does not divide the model's {number} {what}: each"
                " tensor-parallel rank holds whole heads. Use a tensor_parallel_size that divides both"
                f" {number} and the {stage_ranks} ranks of a pipeline stage ({_nearest(dims.tp, fitting_sizes(number, stage_ranks))})."
            )
    shard_ranks = dims.shard * dims.cp
    if sizes.experts and sizes.experts % dims.ep:
        raise error(
            f"{flag('expert_parallel_size', dims.ep)} does not divide the model's {sizes.experts} experts per"
            " experts module: each expert-parallel rank holds whole experts. Use an expert_parallel_size that"
            f" divides both {sizes.experts} and the {shard_ranks} ranks that shard each replica"
            f" ({_nearest(dims.ep, fitting_sizes(sizes.experts, shard_ranks))})."
        )
    stages = dims.pp * stages_per_rank
    if sizes.layers is not None and dims.pp > 1 and sizes.layers < stages:
        fitting = [d for d in range(1, dims.world_size + 1) if dims.world_size % d == 0]
        fitting = [d for d in fitting if d * stages_per_rank <= sizes.layers]
        raise error(
            f"{flag('pipeline_parallel_size', dims.pp)} cuts the model into {stages} stages"
            f" (stages_per_rank={stages_per_rank}), but it has only {sizes.layers} blocks (layers): each stage"
            " needs one. Use a pipeline_parallel_size that divides the world size"
            f" {dims.world_size} with at most {sizes.layers} stages in all ({_nearest(dims.pp, fitting)})."
        )


__all__ = ["ModelSizes", "check_model_sizes", "fitting_sizes"]
