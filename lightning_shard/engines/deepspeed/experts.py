"""Expert parallelism under the DeepSpeed engine (ZeRO 0-2): the same dispatch, DeepSpeed's MoE reduction.

The experts are split by :mod:`lightning_shard.expert_parallel` exactly as under the FSDP engine (each rank
keeps ``E/ep`` whole experts; tokens reach them by all-to-all). What changes is who reduces and steps them:

- each expert parameter becomes a plain tensor, the rank's ``[E/ep, ...]`` block (DeepSpeed flattens what it
  partitions and cannot take a DTensor), marked as DeepSpeed marks its own MoE parameters (``allreduce=False``,
  ``group_name='ep_size_<ep>'``);
- DeepSpeed's expert groups are this run's: the expert-parallel group is the mesh's ``ep`` dimension and the
  expert data-parallel group the ranks holding the same block (DeepSpeed's own layout, consecutive ranks per
  expert-parallel group, is the same; the entries are written from the mesh so that a later call of the same
  process, with new groups, never reuses stale ones);
- the optimizer is rebuilt with the same class and hyperparameters, the expert blocks in param groups of their
  own (``moe=True``, DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``), so ZeRO-1/2 average
  their gradients over the expert data-parallel group only and partition their state over it; every other
  gradient is averaged over all ranks as before. The LR schedulers keep the user's groups; before each step
  every expert group takes the hyperparameters of the group it came from (:meth:`ExpertGroups.follow`);
- DeepSpeed's engine recognises MoE models by its own layer classes only, so the engine is built through a
  subclass that says it has MoE layers (:func:`engine_class`).

The clip norm is DeepSpeed's (ZeRO-1/2 sum the squared norms of every rank's partitions over all ranks, so
each expert block counts once; the expert data-parallel average of the result leaves it as it is).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_shard._optim import constructor_defaults
from lightning_shard.checkpoint.layout import DEEPSPEED_EXPERTS, DEEPSPEED_TAG, expert_blocks_file
from lightning_shard.engines.base import RunContext
from lightning_shard.expert_parallel import expert_modules, expert_shards

#: Set on a model whose expert blocks were made DeepSpeed MoE parameters.
_LOCAL = "_lightning_shard_deepspeed_experts"
#: DeepSpeed's key of the param groups it splits.
_NAME = "name"


def group_name(ep: int) -> str:
    """DeepSpeed's name of the expert groups of size ``ep`` (its ``_create_expert_and_data_parallel``'s)."""
    return f"ep_size_{ep}"


def has_experts(model: nn.Module) -> bool:
    return bool(expert_modules(model))


def make_local(model: nn.Module) -> None:
    """Each expert parameter's block as a plain parameter DeepSpeed reduces over the expert data-parallel
    group only (once per model: a later Trainer call finds them converted)."""
    if getattr(model, _LOCAL, False):
        return
    for module_name, shard in expert_shards(model).items():
        module = model.get_submodule(module_name)
        # ZeRO-1/2 divide every gradient bucket by the whole data-parallel size before an expert block is
        # summed over its expert data-parallel ranks: the local sum over the expert-parallel group's tokens,
        # unscaled, then becomes the mean over every rank's batch (under FSDP2 the 1/ep is expert parallelism's).
        shard.gradient_scale = 1.0
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                continue
            local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
            local.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's MoE parameter marks
            local.group_name = group_name(shard.ep_size)  # type: ignore[attr-defined]
            module._parameters[name] = local
    setattr(model, _LOCAL, True)


@contextlib.contextmanager
def blocks_as_dtensors(model: nn.Module) -> Iterator[None]:
    """Inside, each expert block is seen as the ``Shard(0)`` DTensor it was made from (sharing its storage), so
    that a reader of full weights (``init_weights``) fills each rank's rows of the whole expert tensor."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    if getattr(model, _LOCAL, False):
        for module_name, shard in expert_shards(model).items():
            module = model.get_submodule(module_name)
            for name, block in list(module.named_parameters(recurse=False)):
                if getattr(block, "group_name", None) is None:
                    continue
                shape = torch.Size((block.shape[0] * shard.ep_size, *block.shape[1:]))
                stride = torch.empty(shape, device="meta").stride()
                whole = DTensor.from_local(
                    block.data, shard.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
                )
                module._parameters[name] = nn.Parameter(whole, requires_grad=block.requires_grad)
                swapped.append((module, name, block))
    try:
        yield
    finally:
        for module, name, block in swapped:
            module._parameters[name] = block


def register_groups(ep_mesh: Any, data_mesh: Any) -> None:
    """Point DeepSpeed's expert group tables at this run's groups (see the module docstring)."""
    from deepspeed.utils import groups  # optional: DeepSpeed

    name = group_name(ep_mesh.size())
    for table, ranks, mesh in (
        (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ep_mesh),
        (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, data_mesh),
    ):
        table[name] = mesh.get_group()
        ranks[name] = mesh.mesh.flatten().tolist()


def optimizer_groups(model: nn.Module, optimizer: Optimizer, run: RunContext) -> ExpertGroups | None:
    """Before ``deepspeed.initialize``: DeepSpeed's expert groups pointed at this run's meshes, and ``optimizer``
    rebuilt with the expert blocks in groups of their own (None for a model without experts)."""
    if not has_experts(model):
        return None
    meshes = run.meshes
    assert meshes is not None and meshes.expert is not None
    register_groups(meshes.expert_parallel, meshes.expert_data_parallel)
    return split_groups(optimizer)


@dataclass
class ExpertGroups:
    """The optimizer rebuilt with the expert blocks in groups of their own, and where each came from."""

    optimizer: Optimizer
    parents: list[tuple[dict[str, Any], dict[str, Any]]]  # (expert group, the user's group it came from)

    def follow(self) -> None:
        """Every expert group takes its parent's hyperparameters (an LR scheduler steps the parents only)."""
        for group, parent in self.parents:
            group.update({k: v for k, v in parent.items() if k not in ("params", _NAME, "moe")})


def split_groups(optimizer: Optimizer) -> ExpertGroups:
    """``optimizer``'s class and hyperparameters, each param group's expert blocks moved to groups of their own."""
    from deepspeed.moe.utils import (  # optional: DeepSpeed
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    groups = [{**group, _NAME: f"group{i}"} for i, group in enumerate(optimizer.param_groups)]
    split = split_params_into_different_moe_groups_for_optimizer([dict(g) for g in groups])
    rebuilt = type(optimizer)(split, **constructor_defaults(optimizer))
    parents: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for group in rebuilt.param_groups:
        if group.get("moe"):
            # DeepSpeed names a split group after its expert group; its parameters say which user group it was.
            first = group["params"][0]
            origin = next(i for i, g in enumerate(groups) if any(p is first for p in g["params"]))
            parents.append((group, rebuilt.param_groups[origin]))
        else:
            assert not any(is_moe_param(p) for p in group["params"])
            group.pop(_NAME, None)
    return ExpertGroups(rebuilt, parents)


@functools.cache
def engine_class() -> type:
    """DeepSpeed's engine, told that the model has MoE layers (its own check looks for its MoE classes only)."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # optional: DeepSpeed

    class ExpertParallelEngine(DeepSpeedEngine):  # type: ignore[misc]
        def _configure_distributed_model(self, model: nn.Module) -> None:
            super()._configure_distributed_model(model)
            self.has_moe_layers = True
            self.num_experts = [shard.num_experts for shard in expert_shards(model).values()]

    return ExpertParallelEngine


def initialize(model: nn.Module, optimizer: Optimizer, config: dict[str, Any]) -> tuple[Any, Any]:
    """``deepspeed.initialize`` for a model with expert blocks: ``(engine, DeepSpeed's optimizer)``.

    ``deepspeed.initialize`` builds the engine class its module names; that name points at
    :func:`engine_class`'s for this call only."""
    import deepspeed  # optional: DeepSpeed

    original = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = engine_class()
    try:
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    finally:
        deepspeed.DeepSpeedEngine = original
    return engine, ds_optimizer


# --- checkpoints -------------------------------------------------------------------------------------
#
# DeepSpeed writes a MoE model's experts from its own MoE layers only, so its files are written and read as
# for a model without MoE layers (the switch below), and each expert block is written beside them, whole and
# fp32 (DeepSpeed's master weights, gathered over the ranks that hold the block): rank 0's model file holds
# rank 0's block only, and ZeRO's partitions of an expert group are partitions of one block. The model file
# names the blocks (``DEEPSPEED_EXPERTS``), so readers of full weights (``load_from_checkpoint``,
# ``consolidate``, ``export``) put each expert parameter together from its blocks.


@contextlib.contextmanager
def _as_dense(engine: Any) -> Iterator[None]:
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = True


def _expert_params(engine: Any) -> list[tuple[str, nn.Parameter]]:
    from deepspeed.moe.utils import is_moe_param  # optional: DeepSpeed

    return [(name, p) for name, p in engine.module.named_parameters() if is_moe_param(p)]


def _ep(model: nn.Module) -> tuple[int, int]:
    """``(expert-parallel size, this rank's index in it)``."""
    shard = next(iter(expert_shards(model).values()))
    return shard.ep_size, shard.ep_rank


def save(engine: Any, folder: Path, client_state: dict[str, Any], run: RunContext) -> None:
    """DeepSpeed's checkpoint of ``engine`` in ``folder``, and the expert blocks beside it (every rank calls;
    the first rank of each expert data-parallel group writes its block)."""
    from deepspeed.utils import safe_get_full_fp32_param  # optional: DeepSpeed

    assert run.meshes is not None
    data_rank = run.meshes.expert_data_parallel.get_local_rank()

    size, rank = _ep(engine.module)
    blocks = {}
    for name, param in _expert_params(engine):  # collective over each block's ranks, in the same order
        full = safe_get_full_fp32_param(param)
        blocks[name] = (param if full is None else full).detach().float().cpu().clone()
    tag = folder / DEEPSPEED_TAG
    tag.mkdir(parents=True, exist_ok=True)
    if data_rank == 0:  # one writer per block
        torch.save({"size": size, "rank": rank, "blocks": blocks}, tag / expert_blocks_file(rank))
    index = {
        "size": size,
        "names": list(blocks),
        "shapes": {name: [block.shape[0] * size, *block.shape[1:]] for name, block in blocks.items()},
    }
    with _as_dense(engine):
        engine.save_checkpoint(
            str(folder), tag=DEEPSPEED_TAG, client_state={**client_state, DEEPSPEED_EXPERTS: index}
        )


def saved_size(folder: Path) -> int:
    """The expert-parallel size a DeepSpeed checkpoint was written with (1: none)."""
    return len(list((folder / DEEPSPEED_TAG).glob(expert_blocks_file(0).replace("00", "*")))) or 1


def check_resume(folder: Path, engine: Any, world_size: int) -> None:
    """A DeepSpeed checkpoint resumes under expert parallelism only with the layout it was written with."""
    model = engine.module
    saved = saved_size(folder)
    saved_world = (
        len(list((folder / DEEPSPEED_TAG).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))) or None
    )
    ep = _ep(model)[0] if has_experts(model) else 1
    if saved == ep == 1 or (saved == ep and saved_world in (None, world_size)):
        return
    raise ValueError(
        f"The DeepSpeed checkpoint {str(folder)!r} was written with expert_parallel_size={saved} on"
        f" {saved_world or '?'} ranks; this run has expert_parallel_size={ep} on {world_size} ranks. Under"
        " engine='deepspeed' a checkpoint with expert parallelism resumes with the same expert-parallel size and"
        " number of ranks. To continue on another layout, write its full weights (`lightning-shard consolidate"
        " CHECKPOINT OUT.pt`) and start from them (ShardStrategy(init_weights='OUT.pt')), or train with"
        " engine='fsdp', whose sharded checkpoints reshard between expert-parallel sizes."
    )


def load(engine: Any, folder: Path) -> dict[str, Any]:
    """Resume ``engine`` from :func:`save`'s checkpoint: DeepSpeed's files, then this rank's expert blocks."""
    with _as_dense(engine):
        loaded, client_state = engine.load_checkpoint(
            str(folder), tag=DEEPSPEED_TAG, load_lr_scheduler_states=False
        )
    if loaded is None:
        raise ValueError(f"DeepSpeed found no checkpoint under {str(folder)!r} (tag {DEEPSPEED_TAG!r}).")
    _, rank = _ep(engine.module)
    saved = torch.load(
        folder / DEEPSPEED_TAG / expert_blocks_file(rank), map_location="cpu", weights_only=True
    )
    with torch.no_grad():
        for name, param in _expert_params(engine):
            param.copy_(saved["blocks"][name])
    return dict(client_state)


def local_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full weights narrowed to this rank's expert blocks, for a model whose experts are DeepSpeed's blocks."""
    if not getattr(model, _LOCAL, False):
        return weights
    out = dict(weights)
    for module_name, module in model.named_modules():
        shard = getattr(module, "expert_shard", None)
        if shard is None:
            continue
        for name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            if key in out:
                out[key] = out[key].narrow(0, shard.first, shard.num_local)
    return out
