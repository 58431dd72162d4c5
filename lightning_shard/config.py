"""One validated configuration: every ShardStrategy flag and every engine-neutral cross-flag rule.

``ShardConfig.from_flags(...)`` checks the flags against each other; what the chosen engine serves is
that engine's declaration (``engines/capabilities.py``), checked right after by ``engines.configure``, the
one entry point both doors and the planner call when the strategy is built, before any process starts.
The engines, ``stage="auto"`` and the planner read the same frozen object, so the planner can only
recommend what the strategy accepts and the installed packages can run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning_shard import offload
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
        value and fix (``TypeError`` for a name that is not a flag).

        ``engine`` must name the engine already chosen: ``lightning_shard.engines.configure`` resolves
        ``engine="auto"`` from the engines' declarations, calls this, then checks the result against the
        chosen engine's (``engines/capabilities.py``).
        """
        flags = ShardFlags(**given)
        values = {name: getattr(flags, name) for name in FLAG_NAMES}
        stage = flags.stage  # narrowed below (stage='auto' with parameter offload is stage 3)
        if flags.engine == "auto":
            raise ValueError(
                "ShardConfig.from_flags(engine='auto') needs the engine chosen first: build the configuration with"
                " lightning_shard.engines.configure(...), which chooses it from the engines' declarations."
            )
        _check_scalars(stage, flags.checkpoint, flags.async_checkpoint, flags.max_skipped)
        # With stage="auto", offload flags are checked as at stage 3, where every one of them is allowed.
        offload.validate(
            3 if stage == "auto" else stage, flags.offload_optimizer, flags.offload_params, flags.nvme_path
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
        checkpointing = ActivationCheckpointingConfig.from_flag(
            flags.activation_checkpointing, "ShardStrategy(activation_checkpointing=...)"
        )
        _check_init_weights(flags.init_weights)
        plan = _check_layout(flags.replicate_size, flags.tensor_parallel_size, flags.tensor_parallel_plan)
        _check_context_parallel(flags.context_parallel_size, flags.context_parallel_method)
        _check_expert_parallel(flags)
        _check_tiling(flags.tiled_mlp, flags.tiled_loss, flags.pipeline_parallel_size)
        compile_kwargs = check_compile(flags.compile)
        fp8 = check_fp8(flags.fp8, stage, flags.tensor_parallel_size)
        compression = check_compression(flags.gradient_compression, flags.checkpoint, stage)
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
            flags.checkpoint,
        )
        values.update(
            stage=stage,
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
                flags, stage, (ddp_kwargs or {}).get("ddp_comm_hook") is not None
            ),
        )
        return cls(**values, ddp_kwargs=dict(ddp_kwargs or {}))

    def replace(self, **changes: Any) -> ShardConfig:
        """A copy with ``changes`` (``stage="auto"`` resolved at setup, say), its engine-neutral rules checked
        again; the caller checks it against the engine's declaration (``engines.capabilities.check``)."""
        if "stage" in changes and changes["stage"] not in STAGES:
            raise ValueError(f"ShardConfig.replace(stage={changes['stage']!r}) is not a ZeRO stage.")
        changed = dataclasses.replace(self, **changes)
        _check_layout(changed.replicate_size, changed.tensor_parallel_size, changed.tensor_parallel_plan)
        return changed

    @property
    def resolved_stage(self) -> int:
        """The ZeRO stage; only valid once ``stage="auto"`` has been resolved at setup."""
        if not isinstance(self.stage, int):
            raise RuntimeError(
                "ShardStrategy(stage='auto') is only resolved once the Trainer sets the model up."
            )
        return self.stage


def _check_layout(replicate: Any, tp: Any, plan: Any) -> dict[str, Any] | None:
    """``replicate_size`` / ``tensor_parallel_size`` / ``tensor_parallel_plan`` against each other (the stages
    that serve them are the engine's ``Capabilities.dims``; whether they divide the world size is checked once
    the Trainer knows it)."""
    for flag, value in (("replicate_size", replicate), ("tensor_parallel_size", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"ShardStrategy({flag}={value!r}) must be an integer >= 1 (1: off). The world of W ranks is laid"
                " out as W = replicate_size x shard x tensor_parallel_size."
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


def _check_expert_parallel(flags: ShardFlags) -> None:
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
    if flags.gradient_compression is not None:
        raise ValueError(
            f"ShardStrategy(expert_parallel_size={size}, gradient_compression) is not available: with expert"
            " parallelism the gradients are reduced by FSDP2 (its replicate() at stages 0-1), which takes no DDP"
            " communication hook (docs/expert_parallel.md). Drop gradient_compression, or use"
            " expert_parallel_size=1."
        )


def _check_fault_tolerance(flags: ShardFlags, stage: Any, ddp_hook: bool) -> FaultTolerance | None:
    ft = FaultTolerance.from_flag(flags.fault_tolerance)
    if ft is None:
        return None
    given = "ShardStrategy(fault_tolerance=...,"
    if ft.semi_sync is not None and flags.gradient_compression is not None:
        raise ValueError(
            f"{given} gradient_compression={flags.gradient_compression!r}) with semi_sync={ft.semi_sync.kind!r} is"
            " not available: semi_sync sends the weights' change every sync_every steps, not gradients, and a"
            " compression's error feedback would be kept across syncs it never sees. Drop gradient_compression,"
            " or semi_sync."
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


def _check_scalars(stage: Any, checkpoint: str, async_checkpoint: bool, max_skipped: Any) -> None:
    if stage != "auto" and (isinstance(stage, bool) or stage not in STAGES):
        raise ValueError(
            f"ShardStrategy(stage={stage!r}) is not a ZeRO stage. Use 0 (DDP), 1 (optimizer state sharded),"
            " 2 (+ gradients), 3 (+ parameters), or 'auto' (planned from the model and device memory)."
        )
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
