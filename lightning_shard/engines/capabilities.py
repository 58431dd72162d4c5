"""What an engine supports, declared once on its class, and the one function that refuses the rest.

Each engine class carries ``capabilities``, a :class:`Capabilities`; nothing outside ``engines/`` compares an
engine's name. :func:`refusals` reads the declaration against a :class:`~lightning_shard.config.ShardConfig`
(whose engine-neutral rules ``ShardConfig.from_flags`` has already checked) and returns every refusal, each
the message the user sees; :func:`check` raises the first. ``engines.configure`` runs both when a door is
built, before any process starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_shard.config import ShardConfig

#: Every ZeRO stage.
ALL_STAGES = frozenset({0, 1, 2, 3})
#: The offload targets of ``offload_optimizer`` / ``offload_params``.
_TARGETS = (None, "cpu", "nvme")
#: Every ``(offload_optimizer, offload_params)`` pair the flags accept (their stage rules are engine-neutral).
ALL_OFFLOADS = frozenset((optimizer, params) for optimizer in _TARGETS for params in _TARGETS)


@dataclass(frozen=True)
class Capabilities:
    """One engine's declaration: which flags it serves, at which stages. Only what a refusal or a decision
    outside the engine reads is here; the engine's own checks of a model or precision stay in the engine."""

    name: str
    """The registered name, ``ShardStrategy(engine=...)``."""
    label: str
    """How messages name it ("FSDP2", "DeepSpeed")."""
    dims: Mapping[str, frozenset[int]] = field(hash=False)
    """Parallel dimension -> the stages that serve it; a dimension not listed is refused. ``"replicate"``
    (``replicate_size``), ``"tp"`` (``tensor_parallel_size``), ``"pp"`` (``pipeline_parallel_size``), ``"ep"``
    (``expert_parallel_size``), ``"ft"`` (``fault_tolerance``'s replica groups)."""
    offload: frozenset[tuple[str | None, str | None]]
    """The ``(offload_optimizer, offload_params)`` pairs it serves; ``engine="auto"`` takes the first
    registered engine that serves the pair."""
    checkpoint_modes: frozenset[str]
    """The ``checkpoint=`` modes it writes."""
    async_checkpoint: bool
    """``async_checkpoint=True``: sharded saves written in the background."""
    skip_nonfinite: bool
    """``skip_nonfinite=True``: the strategy may skip a step (the engine does not skip on its own)."""
    fp8: bool
    """``fp8=``: torchao's float8 Linear layers under its data-parallel wrap."""
    ddp_options_stages: frozenset[int]
    """Stages with a ``DistributedDataParallel`` wrapper: its options (``**kwargs``) and
    ``gradient_compression`` (a DDP communication hook) apply there."""
    selective_checkpointing_stages: frozenset[int]
    """Stages where ``activation_checkpointing='selective'`` can replay what it saved."""
    owns_step: bool
    """It runs backward and the optimizer step itself, clips inside it, and fixes the accumulation steps
    when it is built."""
    torch_optimizer: bool
    """The optimizer the loop steps is a ``torch.optim.Optimizer`` (LR finder's scheduler, SWALR)."""
    averaging_stages: frozenset[int]
    """Stages where a callback may copy whole tensors in and out of the parameters (Lightning's
    ``WeightAveraging``, ``StochasticWeightAveraging``)."""
    module_state_after_load: bool
    """After a load, the module's own ``state_dict()`` is the loaded model state (Lightning's hooks read it)."""
    fp8_all_gather: bool = True
    """It gathers sharded weights in float8 (torchao's ``enable_fsdp_float8_all_gather``: FSDP2 at stages 2-3);
    without it the converted layers' weights stay plain tensors, gathered as the engine gathers any other."""
    tensor_parallel: str = "torch"
    """Who splits the layers at ``tensor_parallel_size > 1``: ``"torch"`` (the core's ``parallelize_module``
    on the mesh's ``tp`` dimension, before the engine's wrap) or ``"engine"`` (the engine, inside its wrap:
    DeepSpeed's AutoTP)."""
    absent_because: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Why a dimension absent from :attr:`dims` is (the refusal's reason, measured on the engine's library)."""
    requires: tuple[tuple[str, str], ...] = ()
    """``(package, message)``: an importable package it needs, and the refusal when it is missing."""


def check(config: ShardConfig, caps: Capabilities, flags: Any = None) -> None:
    """Raise ``ValueError`` with the first of :func:`refusals`."""
    found = refusals(config, caps, flags)
    if found:
        raise ValueError(found[0])


def refusals(config: ShardConfig, caps: Capabilities, flags: Any = None) -> list[str]:
    """Why ``caps``' engine cannot run ``config``: each message names the flag as typed, its value and the fix.

    ``flags`` is the :class:`~lightning_shard.flags.ShardFlags` as given (messages quote ``engine='auto'``,
    ``fp8=True`` as the user wrote them); without it, ``config``'s values are quoted.
    """
    given = config if flags is None else flags
    found = [
        _offload(config, caps),
        _required(caps),
        _checkpointing(config, caps, given),
        _activation_checkpointing(config, caps),
        *_layout(config, caps),
        _engine_tensor_parallel(config, caps),
        _ddp_options(config, caps),
        _expert_parallel(config, caps),
        _fp8(config, caps, given),
        *_compression(config, caps, given),
        _pipeline(config, caps),
        _fault_tolerance(config, caps),
    ]
    return [message for message in found if message is not None]


def _offload(config: ShardConfig, caps: Capabilities) -> str | None:
    pair = (config.offload_optimizer, config.offload_params)
    if pair in caps.offload:
        return None
    return (
        f"ShardStrategy(engine={caps.name!r}, offload_optimizer={pair[0]!r}, offload_params={pair[1]!r})"
        f" cannot be served by {caps.label}, which offloads parameters and optimizer state together to CPU only"
        " (stage 3, both 'cpu'). Use engine='deepspeed' (or 'auto')."
    )


def _required(caps: Capabilities) -> str | None:
    for package, message in caps.requires:
        if importlib.util.find_spec(package) is None:
            return message
    return None


def _checkpointing(config: ShardConfig, caps: Capabilities, given: Any) -> str | None:
    refused = [
        flag
        for flag, on, served in (
            ("async_checkpoint=True", config.async_checkpoint, caps.async_checkpoint),
            ("skip_nonfinite=True", config.skip_nonfinite, caps.skip_nonfinite),
        )
        if on and not served
    ]
    if refused:
        return (
            f"ShardStrategy({refused[0]}) is not available with the {caps.label} engine (chosen for"
            f" engine={given.engine!r}, offload_optimizer={config.offload_optimizer!r},"
            f" offload_params={config.offload_params!r}). DeepSpeed writes its own checkpoints and skips fp16"
            " overflow steps itself; use the FSDP2 engine for this flag."
        )
    if config.checkpoint not in caps.checkpoint_modes:
        return (
            f"ShardStrategy(checkpoint={config.checkpoint!r}) is not available with the {caps.label} engine, which"
            " writes its own per-rank checkpoint directory. Use checkpoint='sharded' (then `lightning-shard"
            " consolidate` makes one file), or engine='fsdp'."
        )
    return None


def _activation_checkpointing(config: ShardConfig, caps: Capabilities) -> str | None:
    policy = getattr(config.activation_checkpointing, "policy", None)
    stage = config.stage  # "auto" is checked again once resolved (ShardStrategy.setup)
    if policy != "selective" or stage == "auto" or stage in caps.selective_checkpointing_stages:
        return None
    # ZeRO-3 gathers parameters inside the checkpointed region; the selective policy's saved ops
    # then no longer line up with what the recompute runs.
    return (
        f"ShardStrategy(stage={stage}, engine={caps.name!r}, activation_checkpointing='selective') cannot run:"
        f" {caps.label} ZeRO-3 gathers parameters inside each block, which selective recompute cannot replay."
        f" Use activation_checkpointing='full', or engine='fsdp' for selective checkpointing at stage {stage}."
    )


def _layout(config: ShardConfig, caps: Capabilities) -> list[str | None]:
    """``replicate_size`` and ``tensor_parallel_size`` (whether they divide the world is the mesh's check)."""
    stage, replicate, tp = config.stage, config.replicate_size, config.tensor_parallel_size
    absent = [
        f"{flag}={size}"
        for flag, dim, size in (
            ("tensor_parallel_size", "tp", tp),
            ("replicate_size", "replicate", replicate),
        )
        if size > 1 and dim not in caps.dims
    ]
    if absent:
        flag = absent[0].split("=")[0]
        reason = caps.absent_because.get({"tensor_parallel_size": "tp", "replicate_size": "replicate"}[flag])
        return [
            f"ShardStrategy({absent[0]}) is not available with the {caps.label} engine (chosen by engine= or by"
            " NVMe / optimizer-only CPU offload)" + (f": {reason}" if reason else "") + ". Use engine='fsdp':"
            " FSDP2 composes with torch tensor parallelism and runs HSDP (offload_params='cpu' works there)."
        ]
    if stage == "auto":  # checked again once resolved (ShardStrategy.setup)
        return []
    found: list[str | None] = []
    if replicate > 1 and stage not in caps.dims["replicate"]:
        found.append(
            f"ShardStrategy(stage={stage}, replicate_size={replicate}): replica groups (HSDP) need stage 2 or 3;"
            f" at stage {stage} every data-parallel rank already holds a full replica of the parameters. Use"
            " stage=2 or stage=3, or drop replicate_size."
        )
    if tp > 1 and stage not in caps.dims["tp"]:
        found.append(
            f"ShardStrategy(stage={stage}, tensor_parallel_size={tp}) cannot run: ZeroRedundancyOptimizer does not"
            " take tensor-parallel (DTensor) parameters. Use stage=2 (optimizer state and gradients sharded,"
            " the same all-reduce volume as stage 1) or stage=0."
        )
    return found


def _engine_tensor_parallel(config: ShardConfig, caps: Capabilities) -> str | None:
    """An engine that splits the layers itself (DeepSpeed's AutoTP) takes no torch plan, and its groups are
    ``(data_parallel, tensor_parallel)`` alone."""
    tp = config.tensor_parallel_size
    if tp == 1 or caps.tensor_parallel != "engine":
        return None
    prefix = f"ShardStrategy(engine={caps.name!r}, tensor_parallel_size={tp}"
    if config.tensor_parallel_plan is not None:
        return (
            f"{prefix}, tensor_parallel_plan=...) cannot follow the plan: {caps.label} splits the layers by its"
            " own AutoTP (the Hugging Face plan the model carries, or its parsing of the blocks), not by torch"
            " ParallelStyles. Drop tensor_parallel_plan, or use engine='fsdp' for a plan of your own."
        )
    for flag, size in (
        ("context_parallel_size", config.context_parallel_size),
        ("expert_parallel_size", config.expert_parallel_size),
    ):
        if size > 1:
            return (
                f"{prefix}, {flag}={size}) is not available: {caps.label}'s AutoTP builds its own"
                " (data_parallel, tensor_parallel) groups, which have no room for a third dimension, and its expert"
                " and sequence parallelism are not wired beside it. Use engine='fsdp', which composes both with"
                f" tensor parallelism, or drop {flag}."
            )
    return None


def _ddp_options(config: ShardConfig, caps: Capabilities) -> str | None:
    if not config.ddp_kwargs:
        return None
    flags = ", ".join(f"{k}={v!r}" for k, v in sorted(config.ddp_kwargs.items()))
    if not caps.ddp_options_stages:
        return (
            f"ShardStrategy({flags}) are DistributedDataParallel options, and engine={caps.name!r} has no DDP"
            " wrapper to pass them to. Use engine='fsdp' at stage 0 or 1, or drop them."
        )
    if config.stage not in caps.ddp_options_stages:
        return (
            f"ShardStrategy({flags}) are DistributedDataParallel options, used at stages 0-1 only (got"
            f" stage={config.stage!r}, where FSDP2 shards the model and no DDP wrapper exists). Use stage=0 or 1,"
            " or drop them (FSDP2 needs no find_unused_parameters: unused parameters get no gradient)."
        )
    return None


def _serves(stages: frozenset[int], stage: Any) -> bool:
    """``stage="auto"`` is served only where every stage it could choose is."""
    return stages >= ALL_STAGES if stage == "auto" else stage in stages


def _expert_parallel(config: ShardConfig, caps: Capabilities) -> str | None:
    size, stage = config.expert_parallel_size, config.stage
    if size == 1 or _serves(caps.dims.get("ep", frozenset()), stage):
        return None
    return (
        f"ShardStrategy(expert_parallel_size={size}, engine={caps.name!r}, stage={stage!r}) is not available:"
        f" under the {caps.label} engine the experts are DeepSpeed MoE parameters of ZeRO-1/2, whose optimizer"
        " partitions each block over the ranks that hold it (ZeRO-3 has no expert parallelism; at stage 0 its clip"
        " norm counts only the rank's own experts and its checkpoint holds rank 0's optimizer state; 'auto'"
        f" could choose either). Use stage=1 or 2 with engine={caps.name!r}, or engine='fsdp' at stage 0, 1, 2"
        " or 3 (docs/expert_parallel.md)."
    )


def _fp8(config: ShardConfig, caps: Capabilities, given: Any) -> str | None:
    if config.fp8 is None:
        return None
    if not caps.fp8:
        return (
            f"ShardStrategy(fp8={given.fp8!r}) is not available with the {caps.label} engine (chosen by engine= or"
            " by NVMe / optimizer-only CPU offload): its fp8 path is not wired to this flag. Use engine='fsdp'"
            " (offload_params='cpu' works there)."
        )
    asked = isinstance(given.fp8, dict) and given.fp8.get("enable_fsdp_float8_all_gather")
    if asked and not caps.fp8_all_gather:
        return (
            f"ShardStrategy(fp8={given.fp8!r}) asks for float8 all-gathers, which are FSDP2's: the {caps.label}"
            " engine gathers the converted layers' weights as it gathers any other (in the weights' own dtype)."
            " Drop enable_fsdp_float8_all_gather, or use engine='fsdp'."
        )
    return None


def _compression(config: ShardConfig, caps: Capabilities, given: Any) -> list[str | None]:
    """``gradient_compression`` is a DDP communication hook: it needs the engine's DDP wrapper."""
    if config.gradient_compression is None:
        return []
    flag = f"ShardStrategy(gradient_compression={given.gradient_compression!r})"
    stage, tp = config.stage, config.tensor_parallel_size
    if not caps.ddp_options_stages:
        return [
            f"{flag} compresses DistributedDataParallel's all-reduce, which engine={caps.name!r} does not run."
            " DeepSpeed's compressed optimizers (1-bit Adam, 0/1 Adam) need its NCCL/MPI backends and are not"
            " wired here. Use engine='fsdp' at stage 0 or 1."
        ]
    if stage not in caps.ddp_options_stages:
        return [
            f"{flag} applies at stages 0-1 (DDP's all-reduce); at stage={stage!r} FSDP2 reduce-scatters"
            " gradients with no hook. Use ShardPrecision(reduce_dtype=torch.bfloat16) there, or stage=0 or 1."
        ]
    if tp > 1:
        return [
            f"{flag} needs DistributedDataParallel, and with tensor_parallel_size={tp} stage"
            f" {stage} replicates through FSDP2's replicate(), which has no communication hook. Drop one."
        ]
    return []


def _pipeline(config: ShardConfig, caps: Capabilities) -> str | None:
    size = config.pipeline_parallel_size
    if size == 1 or "pp" in caps.dims:
        return None
    return (
        f"ShardStrategy(pipeline_parallel_size={size}) is not available with the {caps.label} engine (chosen by"
        " engine= or by NVMe / optimizer-only CPU offload): DeepSpeed's PipelineModule needs the model"
        " rewritten as a list of layers. Use engine='fsdp' (torch's pipeline schedules with FSDP2 in each"
        " stage), or pipeline_parallel_size=1."
    )


def _fault_tolerance(config: ShardConfig, caps: Capabilities) -> str | None:
    if config.fault_tolerance is None or "ft" in caps.dims:
        return None
    return (
        f"ShardStrategy(fault_tolerance=..., engine={caps.name!r}) is not available: {caps.label} has no elastic"
        " replicate dimension (its gradient reduction spans one fixed world). Use engine='fsdp'."
    )


__all__ = ["ALL_OFFLOADS", "ALL_STAGES", "Capabilities", "check", "refusals"]
