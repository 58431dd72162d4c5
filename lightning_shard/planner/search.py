"""The search: every candidate configuration weighed, checked against the strategy, and the cheapest chosen."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from torch import nn

from lightning_shard.planner import mesh
from lightning_shard.planner.accepted import StrategyCheck
from lightning_shard.planner.experts import check_fixed, check_flags, parallel_sizes
from lightning_shard.planner.float8 import float8_gathered_params
from lightning_shard.planner.inputs import check_arguments
from lightning_shard.planner.layout import Layout, communication, suggest_layout
from lightning_shard.planner.memory import (
    Breakdown,
    Offload,
    Optimizer,
    Setting,
    breakdown,
    candidates,
    cheapest,
)
from lightning_shard.planner.model import Checkpointing, ModelShape, build_on_meta, model_shape
from lightning_shard.planner.result import Plan
from lightning_shard.units import PlanInputError, format_bytes, parse_bandwidth, parse_size

Stage = Literal[0, 1, 2, 3, "auto"]
Auto = Literal["auto"]


def _per_stage(rows: list[Breakdown]) -> tuple[Breakdown, ...]:
    """For each stage, its cheapest fitting configuration (else its smallest, else why it cannot run)."""
    shown = []
    for stage in (0, 1, 2, 3):
        at_stage = [row for row in rows if row.config.stage == stage]
        shown.append(cheapest(at_stage) or at_stage[0])
    return tuple(shown)


def plan(
    params: int | float | str | None = None,
    *,
    module: nn.Module | None = None,
    model: str | None = None,
    init_args: dict[str, Any] | None = None,
    world_size: int = 1,
    device_memory: int | str,
    precision: str = "bf16-mixed",
    optimizer: Optimizer = "adam",
    stage: Stage = "auto",
    offload_optimizer: Offload | Auto = "auto",
    offload_params: Offload | Auto = "auto",
    activation_checkpointing: Checkpointing | Auto = "auto",
    micro_batch: int | None = 1,
    seq_len: int | None = None,
    margin: float = 0.1,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    ffn: int | None = None,
    layout: bool = False,
    gpus_per_node: int = 8,
    bandwidth: float | str = "25GB/s",
    micro_batches: int | None = None,
    engine: str = "auto",
    nvme_path: str | None = None,
    tensor_parallel_size: int | None = None,
    replicate_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    context_parallel_size: int | Auto | None = None,
    context_parallel_method: str = "allgather",
    fp8: Any = False,
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
    experts: int | None = None,
    top_k: int | None = None,
    expert_parallel_size: int | Auto = "auto",
) -> Plan:
    """Plan one device's memory for every stage and recommend the cheapest configuration that fits.

    The model is ``module`` (counted as is), ``model`` (a class path built on the meta device with
    ``init_args``), or ``params`` (a count such as ``7e9`` or ``"70B"``; the shape is then inferred
    unless ``layers`` / ``hidden`` are given). ``seq_len`` defaults to the model's own (position
    embeddings), else 2048; ``micro_batch=None`` plans model state only. ``"auto"`` flags are searched,
    fixed ones kept; a fixed ``stage`` limits the recommendation, not the table. ``layout=True`` adds the
    TP x PP x DP suggestion for ``world_size`` devices of ``gpus_per_node`` each, and the recommended
    line then carries the mesh flags it implies (``tensor_parallel_size``, ``pipeline_parallel_size``
    with ``microbatches``, ``replicate_size`` for HSDP; see :mod:`.mesh`). Giving
    ``tensor_parallel_size``, ``pipeline_parallel_size`` or ``replicate_size`` fixes the mesh instead
    (the others default to 1): every row is planned for it (with pipeline stages, ``micro_batch`` is one
    microbatch of the ``micro_batches`` a batch is cut into), and ``replicate_size > 1`` limits the
    recommendation to stages 2-3.

    ``context_parallel_size`` fixes the ranks each sequence is cut over (activations of ``seq_len / c``
    tokens, plus what ``context_parallel_method``'s attention keeps of the whole sequence; None is 1);
    ``"auto"`` (the CLI's default) cuts only when nothing fits without it: the smallest power of two that
    divides the data-parallel ranks and makes the recommendation fit is taken, with a note (see :func:`.mesh.with_cp`).

    ``tiled_mlp`` / ``tiled_loss`` plan ``ShardStrategy(tiled_mlp=..., tiled_loss=...)``: the MLPs' hidden
    units are not kept, and the logits and their loss exist one tile at a time (:mod:`lightning_shard.tiling`).

    ``fp8`` is ``ShardStrategy(fp8=...)``'s flag: at stages 2-3 the converted Linears' weights are gathered
    in float8, 1 byte each, in the data-parallel traffic (see :mod:`.float8`).

    A mixture of experts is read from the module (its experts modules, as ``expert_parallel_size`` finds
    them), or planned from ``params`` with ``experts`` = E and ``top_k`` = k (:mod:`.experts`).
    ``expert_parallel_size="auto"`` weighs every e dividing E and the shard group's ranks, up to
    ``gpus_per_node``, and prefers the largest among otherwise equal configurations; an int fixes it.

    Every candidate is checked by ``engines.configure`` and the chosen engine's precision rules
    (with ``engine`` and ``nvme_path`` as given), so a recommendation always constructs a
    ``ShardStrategy``; refused candidates show the strategy's reason (``n/a: ...``) instead.
    """
    check_arguments(locals())
    check_flags(experts, top_k, expert_parallel_size, module is not None or model is not None)
    fixed_mesh = any(
        size is not None for size in (tensor_parallel_size, replicate_size, pipeline_parallel_size)
    )
    tp, replicas, pp = tensor_parallel_size or 1, replicate_size or 1, pipeline_parallel_size or 1
    mesh.check_sizes(world_size, tp, replicas, pp=pp)
    cp = context_parallel_size if isinstance(context_parallel_size, int) else 1
    if (world_size // (tp * replicas * pp)) % cp:
        raise PlanInputError(
            f"plan(context_parallel_size={cp}) does not divide the {world_size // (tp * replicas * pp)} ranks"
            " of a shard group (world_size / (tensor_parallel_size x replicate_size x pipeline_parallel_size))."
            " Use a context_parallel_size that divides them."
        )
    memory = parse_size(device_memory, "device_memory")
    dims = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "ffn": ffn}
    if fp8 and module is None and model is not None:
        module = build_on_meta(model, init_args)  # the Linears fp8 converts are counted on it
    shape = model_shape(module, model, init_args, params, dims, experts, top_k)
    seq = seq_len or shape.seq_len or (2048 if micro_batch else None)
    usable = int(memory * (1 - margin))
    full = Setting(shape, world_size, usable, precision, optimizer, micro_batch, seq)
    setting = mesh.fixed_setting(full, tp, replicas, pp)
    if expert_parallel_size != "auto":
        check_fixed(expert_parallel_size, shape.experts, setting.world_size, shape.source)
    eps = parallel_sizes(setting.world_size, shape.experts, expert_parallel_size, gpus_per_node)
    check = StrategyCheck(engine, nvme_path, precision)
    configs = candidates(
        (0, 1, 2, 3),
        offload_optimizer,
        offload_params,
        activation_checkpointing,
        replicas,
        tp,
        pp,
        micro_batches,
        cp,
        context_parallel_method,
        bool(tiled_mlp),
        bool(tiled_loss),
        eps,
    )
    rows = [check.judge(breakdown(setting, config)) for config in configs]
    # With replicate_size > 1 the strategy refuses stages 0-1 (their rows read n/a): never recommended.
    allowed = [row for row in rows if stage == "auto" or row.config.stage == stage]
    if all(row.unsupported for row in allowed):
        # Explain with the closest miss: the highest stage, with no more offloads than the user asked for.
        closest = min(allowed, key=lambda row: (-row.config.stage, row.config.offloads))
        raise PlanInputError(f"plan(stage={stage!r}): {closest.unsupported}")
    recommended = cheapest(allowed)
    bw = parse_bandwidth(bandwidth, "bandwidth")
    grid: Layout | None = None
    mesh_notes: list[str] = []
    if layout and world_size > 1:
        grid = suggest_layout(
            full,
            gpus_per_node,
            bw,
            micro_batches,
            activation_checkpointing,
            check.judge,
            expert_parallel_size,
        )
        if not fixed_mesh:
            fixed = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_params": offload_params}
            recommended, setting, mesh_notes = _mesh(recommended, setting, grid, fixed, check)
    if context_parallel_size == "auto" and recommended is not None and not recommended.fits:
        cp_row, cp_notes = mesh.with_cp(allowed, setting, check)
        if cp_row is not None:
            recommended, mesh_notes = cp_row, cp_notes
    comm = None
    if recommended is not None and world_size > 1:
        # Over every data-parallel rank, as if flat: HSDP's shard groups do not change it here.
        data_parallel = replace(setting, world_size=world_size // (setting.tp * setting.pp))
        stage_ = recommended.config.stage
        comm = communication(data_parallel, stage_, bw, float8_gathered_params(fp8, stage_, module, shape))
    no_ep = expert_parallel_size == "auto" and shape.experts > 1 and max(eps) == 1
    notes = (
        _notes(shape, micro_batch, recommended, no_ep) + _refused(allowed, recommended, check) + mesh_notes
    )
    return Plan(
        model=shape,
        world_size=world_size,
        device_memory=memory,
        margin=float(margin),
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq,
        stages=_per_stage(rows),
        recommended=recommended,
        communication=comm,
        layout=grid,
        notes=tuple(notes),
        engine=engine,
        nvme_path=nvme_path,
    )


def _mesh(
    row: Breakdown | None, setting: Setting, grid: Layout, fixed: dict[str, Any], check: StrategyCheck
) -> tuple[Breakdown | None, Setting, list[str]]:
    """The recommendation with the mesh flags the layout implies: TP and PP, then HSDP (see :mod:`.mesh`).

    The layout's rows search neither the stage nor offloads the user fixed: its TP / PP option is taken
    only if it keeps them.
    """
    notes: list[str] = []
    option = grid.suggested
    config = option.row.config if option is not None else None
    changed = [k for k, v in fixed.items() if config is not None and v != "auto" and getattr(config, k) != v]
    if not changed:
        row, setting, notes = mesh.with_layout(row, setting, grid)
    elif option is not None and (option.tp > 1 or option.pp > 1):
        notes.append(
            f"The layout's TP={option.tp} x PP={option.pp} option is {option.row.strategy_line}, which changes the"
            f" {' and '.join(changed)} you fixed: the recommended line stays data-parallel."
        )
    if row is not None:
        row, hsdp_notes = mesh.with_hsdp(row, setting, grid.gpus_per_node, check)
        notes += hsdp_notes
    return row, setting, notes


def _notes(shape: ModelShape, micro_batch: int | None, best: Breakdown | None, no_ep: bool) -> list[str]:
    notes = []
    if no_ep:
        notes.append(
            f"No expert_parallel_size > 1 divides both the {shape.experts} experts and the ranks of a shard"
            " group (up to a node's): every device holds every expert."
        )
    if shape.inferred:
        notes.append(
            f"Shape inferred from the parameter count (layers={shape.layers}, hidden={shape.hidden},"
            f" vocab={shape.vocab}); give --layers/--hidden/--vocab or --model for a closer activation estimate."
        )
    if micro_batch is None:
        notes.append("No micro-batch given: activations are not counted, only model state and buffers.")
    if shape.layers == 0:
        notes.append("No repeated blocks found: activations count only the output, and checkpointing is off.")
    if best is not None and not best.fits:
        notes.append(
            "Nothing fits: the recommendation is the configuration with the fewest bytes. Add devices,"
            " lower the micro-batch or sequence length, or use a lower-precision setting."
        )
    if best is not None and best.host:
        notes.append(f"Offloading keeps {best.host / 1e9:.1f} GB per device in host memory (not checked).")
    return notes


def _refused(rows: list[Breakdown], best: Breakdown | None, check: StrategyCheck) -> list[str]:
    """A note when the strategy refuses a configuration that would fit more cheaply than the recommendation.

    Only refusals that read the same at stage 3, where the strategy allows every offload: those are
    about this machine or the fixed flags (DeepSpeed or libaio not installed, the NVMe path, the
    precision), which the user can change, not about a stage the search already moved past; nor about
    expert parallelism, which the search weighs as one more option (its limits are the strategy's design).
    """
    better = [
        row
        for row in rows
        if check.refusal(row.config) is not None
        and check.refusal(row.config) == check.refusal(replace(row.config, stage=3))
        and check.refusal(row.config) == check.refusal(replace(row.config, expert_parallel_size=1))
        and row.total <= row.usable
        and (best is None or not best.fits or row.config.cost() < best.config.cost())
    ]
    if not better:
        return []
    row = min(better, key=lambda r: r.config.cost())
    return [
        f"{row.strategy_line} would fit ({format_bytes(row.total)}), but ShardStrategy refuses it here:"
        f" {row.unsupported}"
    ]


def choose_stage(
    module: nn.Module,
    world_size: int,
    device_memory: int,
    precision: str,
    micro_batch: int | None,
    seq_len: int | None,
    margin: float = 0.1,
    *,
    optimizer: Optimizer = "adam",
    activation_checkpointing: Checkpointing | Auto = "auto",
    offload_optimizer: Offload | Auto = "auto",
    offload_params: Offload | Auto = "auto",
    engine: str = "auto",
    nvme_path: str | None = None,
    tensor_parallel_size: int = 1,
    replicate_size: int = 1,
    pipeline_parallel_size: int = 1,
    micro_batches: int | None = None,
    context_parallel_size: int = 1,
    context_parallel_method: str = "allgather",
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
    expert_parallel_size: int = 1,
) -> Plan:
    """The plan behind ``ShardStrategy(stage="auto")``: the cheapest configuration for this real model.

    Cheapest = lowest stage, then fewest offloads, then least recompute, among configurations whose
    per-device total fits ``(1 - margin) x device_memory``. Flags the user fixed on the strategy are
    passed as fixed values (``engine`` already resolved, ``nvme_path``), so the stage chosen is one
    the strategy accepts; ``"auto"`` ones are searched. The mesh sizes are the strategy's own, kept
    fixed: each rank holds 1 / (``tensor_parallel_size`` x ``pipeline_parallel_size``) of the model
    (``micro_batch`` is then one of the pipeline's ``micro_batches``), and with ``replicate_size > 1``
    (HSDP) the sharded state divides over one shard group and only stages 2-3 are weighed; with
    ``context_parallel_size`` > 1 each rank's activations are those of ``seq_len / c`` tokens plus what the
    method's attention keeps of the whole sequence; ``tiled_mlp`` / ``tiled_loss`` are the strategy's tiling;
    ``expert_parallel_size`` is the strategy's own (its experts per rank, at every stage). If nothing fits,
    ``plan.recommended`` is the
    configuration with the fewest bytes and ``plan.fits`` is False (warn, and train with it: the plan
    is an estimate). Read ``plan.stage``, ``plan.strategy_kwargs()`` and log ``plan.table()``.
    """
    return plan(
        module=module,
        world_size=world_size,
        device_memory=device_memory,
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq_len,
        margin=margin,
        activation_checkpointing=activation_checkpointing,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        engine=engine,
        nvme_path=nvme_path,
        tensor_parallel_size=tensor_parallel_size,
        replicate_size=replicate_size,
        pipeline_parallel_size=pipeline_parallel_size,
        micro_batches=micro_batches,
        context_parallel_size=context_parallel_size,
        context_parallel_method=context_parallel_method,
        tiled_mlp=tiled_mlp,
        tiled_loss=tiled_loss,
        expert_parallel_size=expert_parallel_size,
    )
