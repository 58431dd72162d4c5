"""One validated configuration: every ShardStrategy flag and every cross-flag rule, in one place.

``ShardConfig.from_flags(...)`` runs when the strategy is built, before any process starts, and is
the only place a flag combination is accepted or refused. The engines, ``stage="auto"`` and the
planner read the same frozen object, so the planner can only recommend what the strategy accepts
and the installed packages can run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning_shard import _ddp, offload
from lightning_shard._modules import ModuleClassSpec, resolve_module_classes
from lightning_shard.activation_checkpointing import ActivationCheckpointingConfig
from lightning_shard.checkpoint.init_weights import open_weights
from lightning_shard.compile import check_compile
from lightning_shard.compression import check_compression
from lightning_shard.context_parallel import METHODS
from lightning_shard.fault_tolerance import FaultTolerance
from lightning_shard.flags import FLAG_NAMES, CheckpointMode, EngineFlag, EngineName, ShardFlags
from lightning_shard.fp8 import Fp8Settings, check_fp8
from lightning_shard.parallel.plan import check_plan_flag
from lightning_shard.pipeline.schedules import check_pipeline_flags
from lightning_shard.units import parse_size

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ShardConfig(ShardFlags):
    """The flags (:class:`~lightning_shard.flags.ShardFlags`, declared there once) after validation.

    Built by :meth:`from_flags`. The fields re-declared below are the ones validation normalises to a
    narrower type; every other field is the flag as given.
    """

    engine: EngineName = "fsdp"
    """The engine that serves the flags: ``engine="auto"`` resolved (FSDP2 unless a flag needs DeepSpeed)."""
    shard_modules: tuple[type, ...] | None = None
    """Sharding-unit classes at stages 2-3, resolved from import paths (None: the model's repeated block class)."""
    activation_checkpointing: Any = None
    """An ``ActivationCheckpointing`` config, or None."""
    timeout: timedelta | None = None
    init_weights: str | None = None
    microbatches: int = 1
    """Pieces each batch is cut into (default ``2 x pipeline_parallel_size``)."""
    stages_per_rank: int = 1
    pipeline_split_points: tuple[str, ...] | None = None
    compile: dict[str, Any] | None = None
    """``torch.compile`` keyword arguments for each repeated block (None: eager)."""
    fp8: Fp8Settings | None = None
    """Float8 training (torchao) of the chosen Linear layers (None: off)."""
    matrix_optimizer: bool | tuple[type, ...] | None = None
    """Whole-matrix optimizers: ``None`` (the known classes), every optimizer or none, or the classes named."""
    fault_tolerance: Any = None
    """A checked ``FaultTolerance`` (replica groups healed from a live peer, torchft), or None."""
    gradient_compression: dict[str, Any] | None = None
    """Stages 0-1: ``{"method": "bf16" | "fp16" | "powersgd", **PowerSGDState options}`` (None: off)."""
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    """Lightning's DDPStrategy options (stages 0-1): ``DistributedDataParallel`` arguments and comm hook."""

    @classmethod
    def from_flags(cls, ddp_kwargs: dict[str, Any] | None = None, **given: Any) -> ShardConfig:
        """Check every flag (``ShardFlags``' names) against the others; raise ``ValueError`` naming the flag,
        value and fix (``TypeError`` for a name that is not a flag)."""
        flags = ShardFlags(**given)
        values = {name: getattr(flags, name) for name in FLAG_NAMES}
        stage = flags.stage  # narrowed below (stage='auto' with parameter offload is stage 3)
        _check_scalars(stage, flags.engine, flags.checkpoint, flags.async_checkpoint, flags.max_skipped)
        # With stage="auto", offload flags are checked as at stage 3, where every one of them is allowed.
        engine_name = offload.validate(
            3 if stage == "auto" else stage,
            flags.offload_optimizer,
            flags.offload_params,
            flags.nvme_path,
            flags.engine,
        )
        if stage == "auto" and flags.offload_params is not None:
            stage = 3  # parameter offload exists only at stage 3: nothing left to choose
        if flags.device_memory is not None:
            if stage != "auto":
                raise ValueError(
                    f"ShardStrategy(device_memory={flags.device_memory!r}) is only used with stage='auto' (got stage={stage})."
                    " Drop device_memory or set stage='auto'."
                )
            parse_size(flags.device_memory, "ShardStrategy(device_memory)")
        if engine_name == "deepspeed" and (flags.async_checkpoint or flags.skip_nonfinite):
            flag = "async_checkpoint=True" if flags.async_checkpoint else "skip_nonfinite=True"
            raise ValueError(
                f"ShardStrategy({flag}) is not available with the DeepSpeed engine (chosen for engine={flags.engine!r},"
                f" offload_optimizer={flags.offload_optimizer!r}, offload_params={flags.offload_params!r}). DeepSpeed writes"
                " its own checkpoints and skips fp16 overflow steps itself; use the FSDP2 engine for this flag."
            )
        if engine_name == "deepspeed" and flags.checkpoint == "full":
            raise ValueError(
                "ShardStrategy(checkpoint='full') is not available with the DeepSpeed engine, which writes its own"
                " per-rank checkpoint directory. Use checkpoint='sharded' (then `lightning-shard consolidate` makes"
                " one file), or engine='fsdp'."
            )
        checkpointing = ActivationCheckpointingConfig.from_flag(
            flags.activation_checkpointing, "ShardStrategy(activation_checkpointing=...)"
        )
        _check_checkpointing(stage, engine_name, checkpointing)
        _check_init_weights(flags.init_weights)
        plan = _check_layout(
            stage, engine_name, flags.replicate_size, flags.tensor_parallel_size, flags.tensor_parallel_plan
        )
        _ddp.check(ddp_kwargs or {}, stage, engine_name)
        _check_context_parallel(flags.context_parallel_size, flags.context_parallel_method)
        _check_expert_parallel(flags, stage, engine_name)
        _check_tiling(flags.tiled_mlp, flags.tiled_loss, flags.pipeline_parallel_size)
        compile_kwargs = check_compile(flags.compile, engine_name)
        fp8 = check_fp8(flags.fp8, engine_name, stage, flags.tensor_parallel_size)
        compression = check_compression(
            flags.gradient_compression, stage, engine_name, flags.checkpoint, flags.tensor_parallel_size
        )
        if compression is not None and (ddp_kwargs or {}).get("ddp_comm_hook") is not None:
            raise ValueError(
                f"ShardStrategy(gradient_compression={flags.gradient_compression!r}) and ddp_comm_hook=... both set how"
                " gradients are all-reduced. Keep one."
            )
        microbatches, stages_per_rank, split_points = check_pipeline_flags(
            flags.pipeline_parallel_size,
            flags.pipeline_schedule,
            flags.microbatches,
            flags.stages_per_rank,
            flags.pipeline_split_points,
            engine_name,
            flags.checkpoint,
        )
        values.update(
            stage=stage,
            engine=engine_name,
            shard_modules=resolve_module_classes(flags.shard_modules, "ShardStrategy(shard_modules=...)"),
            activation_checkpointing=checkpointing,
            init_weights=None if flags.init_weights is None else str(flags.init_weights),
            tensor_parallel_plan=plan,
            microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            pipeline_split_points=split_points,
            compile=compile_kwargs,
            fp8=fp8,
            gradient_compression=compression,
            matrix_optimizer=_check_matrix_optimizer(flags.matrix_optimizer),
            fault_tolerance=_check_fault_tolerance(
                flags, stage, engine_name, (ddp_kwargs or {}).get("ddp_comm_hook") is not None
            ),
        )
        return cls(**values, ddp_kwargs=dict(ddp_kwargs or {}))

    def replace(self, **changes: Any) -> ShardConfig:
        """A copy with ``changes`` (``stage="auto"`` resolved at setup, say), checked again."""
        if "stage" in changes and changes["stage"] not in STAGES:
            raise ValueError(f"ShardConfig.replace(stage={changes['stage']!r}) is not a ZeRO stage.")
        changed = dataclasses.replace(self, **changes)
        _check_checkpointing(changed.stage, changed.engine, changed.activation_checkpointing)
        _check_layout(
            changed.stage,
            changed.engine,
            changed.replicate_size,
            changed.tensor_parallel_size,
            changed.tensor_parallel_plan,
        )
        return changed

    @property
    def resolved_stage(self) -> int:
        """The ZeRO stage; only valid once ``stage="auto"`` has been resolved at setup."""
        if not isinstance(self.stage, int):
            raise RuntimeError(
                "ShardStrategy(stage='auto') is only resolved once the Trainer sets the model up."
            )
        return self.stage


def _check_checkpointing(stage: Any, engine: str, checkpointing: Any) -> None:
    policy = getattr(checkpointing, "policy", None)
    if engine == "deepspeed" and stage == 3 and policy == "selective":
        # ZeRO-3 gathers parameters inside the checkpointed region; the selective policy's saved ops
        # then no longer line up with what the recompute runs.
        raise ValueError(
            "ShardStrategy(stage=3, engine='deepspeed', activation_checkpointing='selective') cannot run:"
            " DeepSpeed ZeRO-3 gathers parameters inside each block, which selective recompute cannot replay."
            " Use activation_checkpointing='full', or engine='fsdp' for selective checkpointing at stage 3."
        )


def _check_layout(stage: Any, engine: str, replicate: Any, tp: Any, plan: Any) -> dict[str, Any] | None:
    """``replicate_size`` / ``tensor_parallel_size`` / ``tensor_parallel_plan`` against each other and the
    rest (whether they divide the world size is checked once the Trainer knows it)."""
    for flag, value in (("replicate_size", replicate), ("tensor_parallel_size", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"ShardStrategy({flag}={value!r}) must be an integer >= 1 (1: off). The world of W ranks is laid"
                " out as W = replicate_size x shard x tensor_parallel_size."
            )
    if engine == "deepspeed" and (tp > 1 or replicate > 1):
        flag = f"tensor_parallel_size={tp}" if tp > 1 else f"replicate_size={replicate}"
        raise ValueError(
            f"ShardStrategy({flag}) is not available with the DeepSpeed engine (chosen by engine= or by NVMe /"
            " optimizer-only CPU offload). Use engine='fsdp': FSDP2 composes with torch tensor parallelism and"
            " runs HSDP (offload_params='cpu' works there); DeepSpeed's own tensor parallelism (AutoTP) and"
            " hierarchical partitioning are not wired to these flags."
        )
    if replicate > 1 and stage in (0, 1):
        raise ValueError(
            f"ShardStrategy(stage={stage}, replicate_size={replicate}): replica groups (HSDP) need stage 2 or 3;"
            f" at stage {stage} every data-parallel rank already holds a full replica of the parameters. Use"
            " stage=2 or stage=3, or drop replicate_size."
        )
    if tp > 1 and stage == 1:
        raise ValueError(
            f"ShardStrategy(stage=1, tensor_parallel_size={tp}) cannot run: ZeroRedundancyOptimizer does not"
            " take tensor-parallel (DTensor) parameters. Use stage=2 (optimizer state and gradients sharded,"
            " the same all-reduce volume as stage 1) or stage=0."
        )
    checked = check_plan_flag(plan)
    if checked is not None and tp == 1:
        raise ValueError(
            "ShardStrategy(tensor_parallel_plan=...) is only used with tensor_parallel_size > 1 (got 1). Set"
            " tensor_parallel_size, or drop the plan."
        )
    return checked


def _check_context_parallel(size: Any, method: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"ShardStrategy(context_parallel_size={size!r}) must be an integer >= 1 (1: off): the ranks each"
            " sequence is cut over."
        )
    if method not in METHODS:
        raise ValueError(
            f"ShardStrategy(context_parallel_method={method!r}) is unknown. Use 'allgather' (any backend),"
            " 'ulysses' (any backend, head counts divisible by context_parallel_size) or 'ring' (CUDA)."
        )
    if size == 1:
        if method != "allgather":
            raise ValueError(
                f"ShardStrategy(context_parallel_method={method!r}) is only used with context_parallel_size > 1"
                " (got 1). Set context_parallel_size, or drop context_parallel_method."
            )


def _check_expert_parallel(flags: ShardFlags, stage: Any, engine: str) -> None:
    size, plan = flags.expert_parallel_size, flags.expert_parallel_plan
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"ShardStrategy(expert_parallel_size={size!r}) must be an integer >= 1 (1: off): the ranks each"
            " experts module's experts are split over."
        )
    if plan is not None and (
        not isinstance(plan, dict) or not plan or not all(isinstance(k, str) for k in plan)
    ):
        raise ValueError(
            f"ShardStrategy(expert_parallel_plan={plan!r}) must be a non-empty dict of module-name patterns to"
            " 'experts', e.g. {'blocks.*.moe.experts': 'experts'}."
        )
    if size == 1:
        if plan is not None:
            raise ValueError(
                "ShardStrategy(expert_parallel_plan=...) is read only with expert_parallel_size > 1. Set"
                " expert_parallel_size, or drop the plan."
            )
        return
    if engine == "deepspeed" and stage not in (1, 2):
        raise ValueError(
            f"ShardStrategy(expert_parallel_size={size}, engine='deepspeed', stage={stage!r}) is not available:"
            " under the DeepSpeed engine the experts are DeepSpeed MoE parameters of ZeRO-1/2, whose optimizer"
            " partitions each block over the ranks that hold it (ZeRO-3 has no expert parallelism; at stage 0 its clip"
            " norm counts only the rank's own experts and its checkpoint holds rank 0's optimizer state; 'auto'"
            " could choose either). Use stage=1 or 2 with"
            " engine='deepspeed', or engine='fsdp' at stage 0, 1, 2 or 3 (docs/expert_parallel.md)."
        )
    if flags.gradient_compression is not None:
        raise ValueError(
            f"ShardStrategy(expert_parallel_size={size}, gradient_compression) is not available: with expert"
            " parallelism the gradients are reduced by FSDP2 (its replicate() at stages 0-1), which takes no DDP"
            " communication hook (docs/expert_parallel.md). Drop gradient_compression, or use"
            " expert_parallel_size=1."
        )


def _check_fault_tolerance(
    flags: ShardFlags, stage: Any, engine: str, ddp_hook: bool
) -> FaultTolerance | None:
    ft = FaultTolerance.from_flag(flags.fault_tolerance)
    if ft is None:
        return None
    given = "ShardStrategy(fault_tolerance=...,"
    if engine == "deepspeed":
        raise ValueError(
            f"{given} engine='deepspeed') is not available: DeepSpeed has no elastic replicate dimension (its"
            " gradient reduction spans one fixed world). Use engine='fsdp'."
        )
    if stage == "auto":
        raise ValueError(
            f"{given} stage='auto') is not available: every replica group must shard alike, and 'auto' plans"
            " each from its own devices. Pick stage=0-3 (`lightning-shard plan` recommends one)."
        )
    if stage in (0, 1) and (flags.gradient_compression is not None or ddp_hook):
        raise ValueError(
            f"{given} stage={stage}) takes DDP's communication hook for the cross-group average, so a"
            " gradient_compression or ddp_comm_hook of its own cannot be registered too. Drop one."
        )
    if flags.replicate_size != 1 or flags.pipeline_parallel_size != 1:
        raise ValueError(
            f"{given} replicate_size={flags.replicate_size}, pipeline_parallel_size={flags.pipeline_parallel_size})"
            " is not available: the replica groups are the replicate dimension (each group shards over its own"
            " ranks), and pipeline stages are not healed. Set replicate_size=1 and pipeline_parallel_size=1."
        )
    return ft


def _check_matrix_optimizer(flag: Any) -> bool | tuple[type, ...] | None:
    if flag is None or isinstance(flag, bool):
        return flag
    from torch.optim import Optimizer

    return resolve_module_classes(flag, "ShardStrategy(matrix_optimizer=...)", Optimizer)


def _check_tiling(tiled_mlp: Any, tiled_loss: Any, pp: int) -> None:
    for name, value in (("tiled_mlp", tiled_mlp), ("tiled_loss", tiled_loss)):
        if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
            raise ValueError(
                f"ShardStrategy({name}={value!r}) must be True, False or a number of tokens per tile >= 1."
            )
    if tiled_loss is not False and pp > 1:
        raise ValueError(
            f"ShardStrategy(tiled_loss={tiled_loss!r}, pipeline_parallel_size={pp}) cannot run: with pipeline"
            " stages the last stage hands the logits to pipeline_loss, so there is no head-and-loss call to"
            " tile. Drop tiled_loss (tiled_mlp works with stages), or use pipeline_parallel_size=1."
        )


def _check_init_weights(path: Any) -> None:
    if path is None:
        return
    if not os.path.exists(path):
        raise ValueError(
            f"ShardStrategy(init_weights={str(path)!r}) does not exist. Pass a torch.save state-dict file (e.g. the"
            " output of `lightning-shard consolidate`), a .safetensors file, or a Hugging Face model directory"
            " (model.safetensors, or model.safetensors.index.json and its shards)."
        )
    open_weights(path).close()  # an unreadable or unsupported file fails here, before any process starts


def _check_scalars(
    stage: Any, engine: str, checkpoint: str, async_checkpoint: bool, max_skipped: Any
) -> None:
    if stage != "auto" and (isinstance(stage, bool) or stage not in STAGES):
        raise ValueError(
            f"ShardStrategy(stage={stage!r}) is not a ZeRO stage. Use 0 (DDP), 1 (optimizer state sharded),"
            " 2 (+ gradients), 3 (+ parameters), or 'auto' (planned from the model and device memory)."
        )
    if engine not in ("auto", "fsdp", "deepspeed"):
        raise ValueError(f"ShardStrategy(engine={engine!r}) is unknown. Use 'auto', 'fsdp' or 'deepspeed'.")
    if checkpoint not in ("sharded", "full"):
        raise ValueError(
            f"ShardStrategy(checkpoint={checkpoint!r}) is unknown. Use 'sharded' (one shard per rank, a directory)"
            " or 'full' (one file readable with torch.load)."
        )
    if async_checkpoint and checkpoint != "sharded":
        raise ValueError(
            f"ShardStrategy(async_checkpoint=True) needs checkpoint='sharded' (got checkpoint={checkpoint!r}):"
            " a single full file is gathered on one rank and cannot be written in the background per shard."
            " Use checkpoint='sharded' or async_checkpoint=False."
        )
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 1:
        raise ValueError(
            f"ShardStrategy(max_skipped={max_skipped!r}) must be an integer >= 1: the number of consecutive"
            " non-finite steps to skip before stopping."
        )


__all__ = ["CheckpointMode", "EngineFlag", "EngineName", "ModuleClassSpec", "ShardConfig"]
