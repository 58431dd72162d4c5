"""One module made ready for a run, the same way from either front door.

:func:`prepare` is the only place where the order of the model transforms is written. Both doors call it
(the Trainer's at ``setup``, Fabric's at ``fabric.setup``) with the flags validated into one
:class:`~lightning_shard.ShardConfig` and the processes already joined; a new capability adds one step
here, not one per door. Read top to bottom, as torchtitan's ``parallelize`` functions are read:

1. activation checkpointing, on the whole model (a pipeline stage may keep too few blocks to detect
   their class from);
2. the pipeline cut: this rank keeps its own stages, before anything shards them; then context
   parallelism: the model's attention runs over its context-parallel group and its position inputs get
   each rank's global positions (the batch itself is cut by the door, per step); then the tiled MLP and
   loss (:mod:`lightning_shard.tiling`);
3. the engine (:mod:`lightning_shard.engines`) is built for the config as now resolved and checks the
   module; then, each a free function below: the precision conversion (``bf16-true``), fp8 (torchao's
   ``Float8Linear``), tensor parallelism, ``torch.compile`` per block (torchtitan's order: the plan splits the
   float8 layers, compile sees the casts and the split, sharding wraps what compile made), with expert
   parallelism right after tensor parallelism (each rank keeps its own experts);
4. the engine's one data-parallel wrap: FSDP2 (or FSDP2's ``replicate()``, DDP, ZeRO-1's optimizer at stages
   0-1) and the allocation of parameters built on the meta device; the DeepSpeed engine allocates here and
   hands the module to ``deepspeed.initialize`` with its optimizer after ``prepare`` returns (when the door sets
   up the optimizer: after step 6, so DeepSpeed copies the loaded weights into its fp32 partitions);
5. the pipeline stage runner, over the set-up stage (with the groups that sum a tied parameter's gradient
   between the stages holding a copy);
6. ``init_weights``: the full weights read into the shards, each rank its own slices; a tied parameter's
   copies then take the first stage's values;
7. a barrier, and the ``timeout`` flag's limit on every group the engine made.

Steps 1, 2, tensor parallelism and 6 run once per module (a later Trainer call, or a second front door, finds the module
already transformed); they leave marks on the module for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard import fp8
from lightning_shard._modules import detect_block_classes
from lightning_shard.activation_checkpointing import apply_activation_checkpointing
from lightning_shard.compile import blocks_to_compile, compile_blocks, recompiles
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel import ContextParallel, apply_context_parallel
from lightning_shard.core.process_groups import ProcessGroups
from lightning_shard.core.session import Session
from lightning_shard.engines import Engine, engine_class
from lightning_shard.expert_parallel import apply_expert_parallel
from lightning_shard.parallel import ParallelMeshes, apply_tensor_parallel, clip_grad_norm_
from lightning_shard.pipeline import StageRunner, keep_stage, plan_stages, stages_of_rank
from lightning_shard.pipeline.runner import Tie
from lightning_shard.pipeline.split import StagePlan
from lightning_shard.precision import PrecisionPolicy
from lightning_shard.tiling import apply_tiled_loss, apply_tiled_mlp

log = logging.getLogger(__name__)

#: Marks left on a prepared module: its stage plan, the block classes detected on the whole model, the
#: activation checkpointing applied, the full weights loaded.
_STAGE = "_lightning_shard_pipeline_stage"
_BLOCKS = "_lightning_shard_block_classes"
_CHECKPOINTED = "_lightning_shard_checkpointed"
_TP_APPLIED = "_lightning_shard_tensor_parallel"
_EP_APPLIED = "_lightning_shard_expert_parallel"
_WEIGHTS = "_lightning_shard_weights_loaded"

LossFn = Callable[[Any, Any], Tensor]


def prepare(
    module: nn.Module,
    config: ShardConfig,
    precision: PrecisionPolicy,
    processes: ProcessGroups,
    *,
    engine: Engine | None = None,
    loss_fn: LossFn | None = None,
    owner: str = "ShardStrategy",
) -> Session:
    """Transform ``module`` for the run, every step in its order (see the module's docstring).

    Args:
        module: the user's module (the LightningModule, or Fabric's ``nn.Module``), built on real memory
            or on the meta device.
        config: the validated flags.
        precision: the engine's precision policy.
        processes: the door's strategy, its processes joined (:class:`~.processes.ProcessGroups`).
        engine: an engine already built for ``config``; rebuilt when step 2 resolves the config further.
        loss_fn: the loss of one microbatch on the last pipeline stage (pipeline stages only).
        owner: the door's class name, for log lines.
    """
    # 1. Activation checkpointing.
    if config.activation_checkpointing is not None and not getattr(module, _CHECKPOINTED, False):
        apply_activation_checkpointing(module, config.activation_checkpointing)
        setattr(module, _CHECKPOINTED, True)
    # 2. The pipeline cut.
    rank = processes.pipeline_stage
    plan = None
    if rank is not None:
        config, plan = _cut_to_stages(module, config, rank, owner)
    # 2b. Context parallelism (the batch is cut per step by the door); the tiled MLP and loss.
    if processes.context_parallel is not None:
        _install_context_parallel(module, processes.context_parallel, processes.root_device.type, owner)
    _install_tiling(module, config, owner)
    # 3. The engine for this config; then precision, fp8, tensor parallelism, compile.
    run = processes.run_context()
    if engine is None or engine.config != config:
        engine = engine_class(config.engine)(config, precision, run)
    engine.check_module(module)
    module = apply_precision(module, precision)
    apply_fp8(module, config)
    apply_tensor_parallel_once(module, processes.meshes, config, engine)
    apply_expert_parallel_once(module, processes.meshes, config)
    apply_compile(module, config, engine)
    # 4. The engine's one data-parallel wrap, and the allocation from meta.
    model = engine.setup_module(module)
    # 5. The stage runner.
    pipeline = None
    if rank is not None:
        assert plan is not None and loss_fn is not None, "pipeline stages need the loss of one microbatch"
        pipeline = _stage_runner(model, config, rank, processes, loss_fn, plan)
    # 6. init_weights; then the copies of a parameter tied across stages take the first stage's values.
    if config.init_weights is not None and getattr(module, _WEIGHTS, None) != config.init_weights:
        engine.load_full_weights(module, config.init_weights)
        setattr(module, _WEIGHTS, config.init_weights)
    if pipeline is not None:
        pipeline.sync_tied()
    # 7. Every rank set up; the engine's groups under the timeout flag.
    processes.barrier()
    processes.apply_timeout()
    return Session(
        model,
        engine,
        config,
        pipeline,
        precision,
        processes.context_parallel,
        processes.root_device,
        pipeline_stages=processes.dims.pp,
    )


def apply_precision(module: nn.Module, precision: PrecisionPolicy) -> nn.Module:
    """The module in the precision's storage dtype (``bf16-true``: bf16 weights; the mixed modes keep fp32)."""
    return precision.convert_module(module)


def apply_fp8(module: nn.Module, config: ShardConfig) -> None:
    """``fp8=...``: torchao's ``Float8Linear`` for the chosen layers (once per module), before tensor
    parallelism, compile and sharding: the plan splits them with torchao's float8 styles, compile sees the
    casts, FSDP2 gathers the float8 weights."""
    if config.fp8 is not None:
        fp8.convert(module, config.fp8)


def apply_tensor_parallel_once(
    module: nn.Module, meshes: ParallelMeshes, config: ShardConfig, engine: Engine
) -> None:
    """``tensor_parallel_size > 1``: the layers split over the tensor-parallel mesh before FSDP2 shards over the
    data-parallel one (torch's 2-D order); a meta module is split before anything is allocated. Once per
    module (a later Trainer call finds it split). Nothing where the engine splits the layers itself, inside its
    wrap (DeepSpeed's AutoTP: ``Capabilities.tensor_parallel``)."""
    tp_mesh = meshes.tensor_parallel
    if (
        tp_mesh is None
        or getattr(module, _TP_APPLIED, False)
        or engine.capabilities.tensor_parallel != "torch"
    ):
        return
    experts_whole = meshes.dims.ep_enabled  # replicated over tp: expert parallelism holds them
    plan = apply_tensor_parallel(module, tp_mesh, config.tensor_parallel_plan, experts_whole)
    setattr(module, _TP_APPLIED, True)
    log.info("ShardStrategy: tensor parallel over %d ranks: %s", tp_mesh.size(), plan)


def apply_expert_parallel_once(module: nn.Module, meshes: ParallelMeshes, config: ShardConfig) -> None:
    """``expert_parallel_size > 1``: each rank keeps its ``E/ep`` experts of every experts module, before compile
    and the data-parallel wrap (which shards each expert block over the ranks left). The experts' gradients are
    scaled by ``1/ep``: their local gradient sums the tokens of the whole expert-parallel group, and the
    data-parallel reduction over the ranks left then gives the mean over every rank's batch. Once per module."""
    ep_mesh = meshes.expert_parallel
    if ep_mesh is None or getattr(module, _EP_APPLIED, False):
        return
    shards = apply_expert_parallel(
        module, ep_mesh, config.expert_parallel_plan, gradient_scale=1.0 / ep_mesh.size()
    )
    setattr(module, _EP_APPLIED, True)
    log.info("ShardStrategy: expert parallel over %d ranks: %s", ep_mesh.size(), sorted(shards))


def apply_compile(module: nn.Module, config: ShardConfig, engine: Engine) -> None:
    """``compile=...``: each repeated block compiled after tensor parallelism and checkpointing, before the
    data-parallel wrap (at DeepSpeed's ZeRO-3 each block a leaf, gathered whole outside the graph)."""
    if config.compile is None:
        return
    options = config.compile or {}
    blocks = blocks_to_compile(module, config.shard_modules, options)
    if compile_blocks(blocks, options, zero3_leaves=engine.compiles_zero3_leaves):
        log.info("ShardStrategy: torch.compile on %d blocks (%s)", len(blocks), config.compile)
    engine.compile_baseline = recompiles()


def prepare_precision(precision: PrecisionPolicy, processes: ProcessGroups) -> None:
    """The precision policy on this rank's device (its loss scaler agrees over every rank), clipping by one
    norm over every mesh where parameters live on several ((dp, tp) and dp, or pipeline stages)."""
    precision.setup_device(processes.root_device, None)
    dims = processes.dims
    if dims.global_clip:
        precision.clip_grad_norm = partial(clip_grad_norm_, pipeline_stages=dims.pp)


def _install_context_parallel(module: nn.Module, cp: ContextParallel, device_type: str, owner: str) -> None:
    if cp.method == "ring" and device_type != "cuda":
        raise ValueError(
            f"{owner}(context_parallel_method='ring') runs torch's ring attention, which serves the CUDA SDPA"
            f" kernels only (this run is on {device_type!r}: CPU attention has no sharding rule there). Use"
            " context_parallel_method='allgather' (or 'ulysses') on this device."
        )
    replaced = apply_context_parallel(module, cp, owner)
    log.info("%s: context parallel (%s) over %d ranks: %s", owner, cp.method, cp.size, replaced)


def _install_tiling(module: nn.Module, config: ShardConfig, owner: str) -> None:
    if config.tiled_mlp is not False:
        names = apply_tiled_mlp(module, config.tiled_mlp, f"{owner}(tiled_mlp={config.tiled_mlp!r})")
        log.info("%s: tiled MLP: %s", owner, names)
    if config.tiled_loss is not False:
        names = apply_tiled_loss(module, config.tiled_loss, f"{owner}(tiled_loss={config.tiled_loss!r})")
        log.info("%s: tiled loss: %s", owner, names)


def _cut_to_stages(
    module: nn.Module, config: ShardConfig, rank: int, owner: str
) -> tuple[ShardConfig, StagePlan]:
    """Keep only pipeline rank ``rank``'s stages of ``module`` (once per module); the config with the block
    classes to shard, detected on the whole model where not given, and the plan that cut it."""
    plan = getattr(module, _STAGE, None)
    if config.shard_modules is None:
        # Detected on the whole model: a stage may keep a single block, too few to detect a class from.
        blocks = getattr(module, _BLOCKS) if plan is not None else detect_block_classes(module)
        config = config.replace(shard_modules=tuple(blocks) or None)
    if plan is not None:
        return config, plan
    setattr(module, _BLOCKS, config.shard_modules or ())
    total = config.pipeline_parallel_size * config.stages_per_rank
    plan = plan_stages(module, total, config.pipeline_split_points)
    own = stages_of_rank(rank, config.pipeline_parallel_size, config.stages_per_rank)
    keep_stage(module, plan, own)
    for stage in own:
        log.info("%s: pipeline stage %d of %d holds %s", owner, stage, total, list(plan.blocks_of(stage)))
    setattr(module, _STAGE, plan)
    return config, plan


def _stage_runner(
    model: nn.Module,
    config: ShardConfig,
    rank: int,
    processes: ProcessGroups,
    loss_fn: LossFn,
    plan: StagePlan,
) -> StageRunner:
    """The runner of pipeline rank ``rank``'s stages of the set-up ``model`` under the flags' schedule."""
    size, per_rank = config.pipeline_parallel_size, config.stages_per_rank
    own = stages_of_rank(rank, size, per_rank)
    return StageRunner(
        model,
        own,
        size * per_rank,
        processes.root_device,
        processes.meshes.pipeline.get_group(),
        config.pipeline_schedule,
        config.microbatches,
        loss_fn,
        plan,
        _ties(processes.device_mesh, plan, size, own),
    )


def _ties(mesh: Any, plan: StagePlan, size: int, own: tuple[int, ...]) -> tuple[Tie, ...]:
    """This rank's copies of parameters tied across stages, each with the group of the ranks holding a copy
    (at this rank's place on the other mesh dimensions), as Megatron sums the embedding's gradient between
    its first and last stage. Every rank creates every group, in the same order."""
    if not plan.tied:
        return ()
    me = dist.get_rank()
    names = list(mesh.mesh_dim_names)
    pipelines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, size).tolist()  # each: its stages' ranks
    ties = []
    for uses in plan.tied:
        holders = sorted({stage % size for _, stage in uses})  # the pipeline ranks holding a copy
        if len(holders) < 2:
            continue  # one rank runs every stage that uses it: one parameter there
        mine = next((name for name, stage in uses if stage in own), None)
        group, src = None, -1
        for ranks in pipelines:
            members = [ranks[h] for h in holders]
            made = mesh["pp"].get_group() if len(holders) == size else dist.new_group(members)
            if me in members:
                group, src = made, members[0]
        if mine is not None:
            ties.append(Tie(mine, group, src, first=me == src))
    return tuple(ties)
