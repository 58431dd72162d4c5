"""``tensor_parallel_size`` under the DeepSpeed engine: DeepSpeed's AutoTP, inside ``deepspeed.initialize``.

DeepSpeed splits the model's linear layers itself when its config carries ``"tensor_parallel": {"autotp_size":
tp}`` (ZeRO 0-3): by the Hugging Face plan the model carries (``config.base_model_tp_plan``: ``q_proj``
column-parallel, ``o_proj`` row-parallel, ...), else by its own parsing of the transformer blocks. Its groups are a
``(data_parallel, tensor_parallel)`` mesh with the tensor-parallel ranks consecutive, the layout
:class:`~lightning_shard.parallel.ParallelDims` gives the world (``W = shard x tp``): :func:`check_groups` holds
DeepSpeed to it after the fact, so the sampler's ranks (``ParallelDims.sampler``) are the ranks DeepSpeed reduces
gradients over, and the ranks of one tensor-parallel group read the same rows.

ZeRO then partitions over the data-parallel ranks alone (``world / tp``), each tensor-parallel rank its own slices;
its checkpoint holds one ``mp_rank_NN`` file per tensor-parallel rank and resumes on the same layout
(:func:`check_resume`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_shard.checkpoint import DEEPSPEED_TAG
from lightning_shard.checkpoint._zero_reader import deepspeed_tensor_parallel_ranks
from lightning_shard.engines.base import RunContext


def config_section(tp: int) -> dict[str, Any]:
    """DeepSpeed's ``tensor_parallel`` section for ``tp`` ranks."""
    return {"autotp_size": tp}


def check_groups(run: RunContext) -> None:
    """DeepSpeed built its own tensor- and data-parallel groups: they must be this layout's (``ParallelDims``, the
    one owner), or the sampler would hand a tensor-parallel group different rows."""
    from deepspeed.utils import groups  # optional: DeepSpeed

    meshes = run.meshes
    assert meshes is not None and meshes.tensor_parallel is not None
    ours = {
        "tensor-parallel": dist.get_process_group_ranks(meshes.tensor_parallel.get_group()),
        "data-parallel": dist.get_process_group_ranks(meshes.data_parallel.get_group()),
    }
    theirs = {
        "tensor-parallel": dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
        "data-parallel": dist.get_process_group_ranks(groups.get_data_parallel_group()),
    }
    for name, ranks in ours.items():
        if sorted(ranks) != sorted(theirs[name]):
            raise RuntimeError(
                f"DeepSpeed's AutoTP put rank {run.global_rank} in the {name} group {theirs[name]}, and this"
                f" layout ({run.dims}) puts it in {ranks}: the data each rank reads would not follow the split"
                " layers. Report this with the DeepSpeed version."
            )


def check_split(model: nn.Module, tp: int) -> None:
    """AutoTP must have split something: a model it cannot parse would train whole on every rank."""
    from deepspeed.module_inject.layers import DS_IS_REPLACED_MODULE  # optional: DeepSpeed

    if not any(getattr(p, DS_IS_REPLACED_MODULE, False) for p in model.parameters()):
        module = getattr(model, "module", model)
        raise ValueError(
            f"ShardStrategy(engine='deepspeed', tensor_parallel_size={tp}): DeepSpeed's AutoTP split no layer of"
            f" {type(module).__name__}. It follows a Hugging Face plan (the module or its `config` carrying"
            " `base_model_tp_plan`) or recognises Hugging Face transformer blocks. Give the LightningModule the"
            " model's config as `self.config`, or use engine='fsdp' with tensor_parallel_plan=... (torch's styles)."
        )


def guard_inputs(engine: Any, run: RunContext) -> None:
    """Replace DeepSpeed's first-step check that a tensor-parallel group reads the same data (it compares only
    tensors at the top of the forward's arguments and fails on a ``(inputs, targets)`` batch) with one over every
    tensor of the arguments, nested ones included."""
    check = getattr(engine, "first_dataloader_check", None)
    if check is not None:
        check.remove()
    meshes = run.meshes
    assert meshes is not None and meshes.tensor_parallel is not None
    group = meshes.tensor_parallel.get_group()
    handle: Any = None

    def same_rows(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        mine = torch.stack([_digest(t) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        if any(not torch.equal(other, mine) for other in gathered):
            raise ValueError(
                f"ShardStrategy(engine='deepspeed', tensor_parallel_size={run.dims.tp}): the ranks of one"
                f" tensor-parallel group read different batches (rank {run.global_rank}'s group is"
                f" {dist.get_process_group_ranks(group)}). They must read the same rows: keep"
                " Trainer(use_distributed_sampler=True), or give your sampler"
                " trainer.strategy.distributed_sampler_kwargs (num_replicas = world size / tensor_parallel_size)."
            )

    handle = engine.module.register_forward_pre_hook(same_rows, prepend=True, with_kwargs=True)


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    """A few numbers that differ when two ranks' tensors do: shape, sum and a position-weighted sum (float64)."""
    flat = tensor.detach().flatten().to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return torch.tensor(
        [float(flat.numel()), float(flat.sum()), float((flat * weights).sum())], dtype=torch.float64
    )


def release() -> None:
    """Drop the tensor- and data-parallel groups DeepSpeed keeps at module level once AutoTP made them: the next
    ``deepspeed.initialize`` in this process (another Trainer call) would take them up again, and one without
    AutoTP fails in DeepSpeed's set-up (its module-level ``groups.mpu`` still says 2 tensor-parallel ranks while
    the new engine has no ``mpu``). The groups themselves are destroyed with the others this run made."""
    from deepspeed.utils import groups  # optional: DeepSpeed

    drop = getattr(groups, "_release_process_group_references", None)  # DeepSpeed 0.19
    if drop is not None:
        drop(None)
        return
    for name in (
        "_TENSOR_MODEL_PARALLEL_GROUP",
        "_MODEL_PARALLEL_GROUP",
        "_DATA_PARALLEL_GROUP",
        "mesh_device",
        "mpu",
    ):
        setattr(groups, name, None)


def saved_sizes(folder: Path) -> tuple[int, int]:
    """``(tensor-parallel ranks, data-parallel ranks)`` a DeepSpeed checkpoint was written with (``0``
    data-parallel ranks: no ZeRO partitions, stage 0)."""
    tag = folder / DEEPSPEED_TAG
    tp = deepspeed_tensor_parallel_ranks(tag) or 1
    dp = len(list(tag.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    return tp, dp


def check_resume(folder: Path, tp: int, data_parallel: int) -> None:
    """A checkpoint with AutoTP slices resumes with the layout it was written with: DeepSpeed's reader takes
    each tensor-parallel rank's file as it is."""
    saved_tp, saved_dp = saved_sizes(folder)
    if saved_tp == 1 and tp == 1:
        return
    if saved_tp == tp and saved_dp in (0, data_parallel):
        return
    raise ValueError(
        f"The DeepSpeed checkpoint {str(folder)!r} was written with tensor_parallel_size={saved_tp} over"
        f" {saved_dp or 'unpartitioned'} data-parallel ranks; this run has tensor_parallel_size={tp} over"
        f" {data_parallel}. Under engine='deepspeed' a checkpoint with tensor parallelism (AutoTP) resumes with the"
        " same tensor_parallel_size and number of ranks. Resume with that layout, or train with engine='fsdp',"
        " whose sharded checkpoints reshard between layouts."
    )


__all__ = [
    "check_groups",
    "check_resume",
    "check_split",
    "config_section",
    "guard_inputs",
    "release",
    "saved_sizes",
]
