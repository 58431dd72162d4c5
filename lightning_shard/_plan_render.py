"""A plan as JSON, as a plain-text table (console and logs), and as stacked bars (matplotlib, optional)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lightning_shard._plan_layout import LayoutOption
from lightning_shard._plan_memory import Breakdown, Config
from lightning_shard._plan_units import PlanInputError, format_bytes, format_count

if TYPE_CHECKING:
    from lightning_shard.planner import Plan

PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def row_dict(row: Breakdown) -> dict[str, Any]:
    return {
        **asdict(row.config),
        "strategy": row.config.strategy_line(),
        **{part: getattr(row, part) for part in PARTS},
        "model_state": row.model_state,
        "total": row.total,
        "host": row.host,
        "fits": row.fits,
        "buffers_detail": dict(row.buffers_detail),
        "unsupported": row.unsupported,
    }


def _layout_dict(option: LayoutOption) -> dict[str, Any]:
    return {
        "tp": option.tp,
        "pp": option.pp,
        "dp": option.dp,
        "stage": option.row.config.stage,
        "activation_checkpointing": option.row.config.activation_checkpointing,
        "per_device_bytes": option.row.total,
        "fits": option.row.fits,
        "micro_batches": option.micro_batches,
        "bubble": option.bubble,
        "allreduce_seconds": option.communication.allreduce_seconds,
        "step_comm_seconds": option.communication.step_seconds,
    }


def to_dict(plan: Plan) -> dict[str, Any]:
    from lightning_shard.planner import JSON_VERSION

    layout = None
    if plan.layout is not None:
        layout = {
            "gpus_per_node": plan.layout.gpus_per_node,
            "options": [_layout_dict(o) for o in plan.layout.options],
            "suggested": _layout_dict(plan.layout.suggested) if plan.layout.suggested else None,
        }
    return {
        "version": JSON_VERSION,
        "model": {**asdict(plan.model), "root_params": plan.model.root_params},
        "inputs": {
            "world_size": plan.world_size,
            "device_memory": plan.device_memory,
            "usable_memory": plan.usable_memory,
            "margin": plan.margin,
            "precision": plan.precision,
            "optimizer": plan.optimizer,
            "micro_batch": plan.micro_batch,
            "seq_len": plan.seq_len,
        },
        "stages": [row_dict(row) for row in plan.stages],
        "recommended": row_dict(plan.recommended) if plan.recommended else None,
        "strategy": plan.strategy,
        "fits": plan.fits,
        "communication": asdict(plan.communication) if plan.communication else None,
        "layout": layout,
        "notes": list(plan.notes),
    }


def _flags(config: Config) -> str:
    parts = []
    if config.offload_optimizer != "none":
        parts.append(f"opt->{config.offload_optimizer}")
    if config.offload_params != "none":
        parts.append(f"params->{config.offload_params}")
    if config.activation_checkpointing != "none":
        parts.append(f"ckpt:{config.activation_checkpointing}")
    return " ".join(parts) or "-"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]


def _row_cells(label: str, row: Breakdown) -> list[str]:
    if row.unsupported:
        return [label, _flags(row.config), *["-"] * (len(PARTS) + 2), f"n/a: {row.unsupported}"]
    sizes = [format_bytes(getattr(row, part)) for part in PARTS]
    sizes.insert(3, format_bytes(row.model_state))
    return [label, _flags(row.config), *sizes, format_bytes(row.total), "yes" if row.fits else "NO"]


def _header(plan: Plan) -> list[str]:
    m = plan.model
    shape = f"{m.layers} layers x {m.hidden} hidden, {m.heads} heads, vocab {m.vocab}"
    batch = f"micro-batch {plan.micro_batch} x seq {plan.seq_len}" if plan.micro_batch else "no micro-batch"
    return [
        f"model: {m.source}, {format_count(m.params)} parameters ({shape}{', inferred' if m.inferred else ''})",
        f"per device: {format_bytes(plan.device_memory)}, usable {format_bytes(plan.usable_memory)}"
        f" (margin {plan.margin:.0%}); {plan.world_size} devices; {plan.precision}, {plan.optimizer}; {batch}",
    ]


def _layout_lines(plan: Plan) -> list[str]:
    assert plan.layout is not None
    rows = [
        [
            str(o.tp),
            str(o.pp),
            str(o.dp),
            str(o.row.config.stage),
            o.row.config.activation_checkpointing,
            format_bytes(o.row.total),
            "yes" if o.row.fits else "NO",
            f"{o.bubble:.0%} (m={o.micro_batches})" if o.pp > 1 else "-",
            f"{o.communication.allreduce_seconds:.2f} s",
        ]
        for o in plan.layout.options
    ]
    header = ["TP", "PP", "DP", "stage", "recompute", "per device", "fits", "bubble", "DP all-reduce"]
    lines = ["", f"layout on paper (TP within a node of {plan.layout.gpus_per_node}, 1F1B pipeline):"]
    lines += _grid(header, rows)
    s = plan.layout.suggested
    if s is None:
        lines.append("suggested: none fits; add devices or lower the micro-batch / sequence length.")
    else:
        lines.append(
            f"suggested: TP={s.tp} x PP={s.pp} x DP={s.dp}, ZeRO stage {s.row.config.stage},"
            f" recompute {s.row.config.activation_checkpointing}: {format_bytes(s.row.total)} per device,"
            f" bubble {s.bubble:.0%}"
        )
    return lines


def table(plan: Plan) -> str:
    header = ["stage", "flags", *PARTS[:3], "model state", *PARTS[3:], "total", "fits"]
    rows = [_row_cells(str(row.config.stage), row) for row in plan.stages]
    lines = [*_header(plan), "", *_grid(header, rows), ""]
    best = plan.recommended
    if best is not None:
        verdict = "fits" if best.fits else "does NOT fit"
        lines.append(
            f"recommended: {best.config.strategy_line()}  ({format_bytes(best.total)} of"
            f" {format_bytes(plan.usable_memory)} usable: {verdict})"
        )
    if plan.communication is not None:
        c = plan.communication
        lines.append(
            f"data parallel: gradient all-reduce of {format_bytes(c.gradient_bytes)} takes {c.allreduce_seconds:.3g} s"
            f" at {format_bytes(c.bandwidth)}/s; stage {plan.stage} moves {format_bytes(c.step_bytes)} per step"
            f" ({c.step_seconds:.3g} s)"
        )
    if plan.layout is not None:
        lines += _layout_lines(plan)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plot(plan: Plan, path: str) -> None:
    try:
        # A bare Figure, not pyplot: no global backend switch and no window, in a notebook or a job.
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlanInputError(
            f"--plot {path} needs matplotlib, which is not installed. Run: pip install lightning-shard[plot]"
        ) from err
    bars = [(f"stage {row.config.stage}\n{_flags(row.config)}", row) for row in plan.stages]
    if plan.recommended is not None:
        bars.append((f"recommended\n{_flags(plan.recommended.config)}", plan.recommended))
    fig = Figure(figsize=(1.8 * len(bars) + 2, 4.5))
    ax = fig.subplots()
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        heights = [getattr(row, part) / 1e9 for _, row in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.axhline(plan.device_memory / 1e9, color="black", linestyle="-", linewidth=1, label="device memory")
    ax.axhline(plan.usable_memory / 1e9, color="black", linestyle="--", linewidth=1, label="usable")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{plan.model.source}: {format_count(plan.model.params)} params, {plan.world_size} devices")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")
