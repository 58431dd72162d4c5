"""Showing rows of a plan: as JSON-ready dicts, as a plain-text grid, and as stacked bars (matplotlib, optional).

These helpers know rows (:class:`~.memory.Breakdown`) and layouts, not the whole
:class:`~.result.Plan`, which composes them in ``to_dict``, ``table`` and ``plot``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_shard.planner.layout import Layout, LayoutOption
from lightning_shard.planner.memory import Breakdown, Config
from lightning_shard.units import PlanInputError, format_bytes

PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def row_dict(row: Breakdown) -> dict[str, Any]:
    return {
        **asdict(row.config),
        "strategy": row.strategy_line,
        **{part: getattr(row, part) for part in PARTS},
        "model_state": row.model_state,
        "total": row.total,
        "host": row.host,
        "fits": row.fits,
        "buffers_detail": dict(row.buffers_detail),
        "expert_parameters": row.expert_parameters,
        "unsupported": row.unsupported,
        "places": [asdict(place) for place in row.places],
    }


def layout_option_dict(option: LayoutOption) -> dict[str, Any]:
    return {
        "tp": option.tp,
        "pp": option.pp,
        "dp": option.dp,
        "ep": option.row.config.expert_parallel_size,
        "stage": option.row.config.stage,
        "activation_checkpointing": option.row.config.activation_checkpointing,
        "per_device_bytes": option.row.total,
        "fits": option.row.fits,
        "micro_batches": option.micro_batches,
        "bubble": option.bubble,
        "allreduce_seconds": option.communication.allreduce_seconds,
        "step_comm_seconds": option.communication.step_seconds,
    }


def layout_dict(layout: Layout) -> dict[str, Any]:
    return {
        "gpus_per_node": layout.gpus_per_node,
        "options": [layout_option_dict(o) for o in layout.options],
        "suggested": layout_option_dict(layout.suggested) if layout.suggested else None,
    }


def flags(config: Config) -> str:
    parts = []
    if config.tensor_parallel_size != 1:
        parts.append(f"tp:{config.tensor_parallel_size}")
    if config.replicate_size != 1:
        parts.append(f"replicas:{config.replicate_size}")
    if config.expert_parallel_size != 1:
        parts.append(f"ep:{config.expert_parallel_size}")
    if config.offload_optimizer != "none":
        parts.append(f"opt->{config.offload_optimizer}")
    if config.offload_params != "none":
        parts.append(f"params->{config.offload_params}")
    if config.activation_checkpointing != "none":
        parts.append(f"ckpt:{config.activation_checkpointing}")
    return " ".join(parts) or "-"


def grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]


def _row_cells(label: str, row: Breakdown) -> list[str]:
    if row.unsupported:
        return [label, flags(row.config), *["-"] * (len(PARTS) + 2), f"n/a: {row.unsupported}"]
    sizes = [format_bytes(getattr(row, part)) for part in PARTS]
    sizes.insert(3, format_bytes(row.model_state))
    return [label, flags(row.config), *sizes, format_bytes(row.total), "yes" if row.fits else "NO"]


def stage_lines(rows: tuple[Breakdown, ...]) -> list[str]:
    """The per-stage grid: one row per stage, its bytes by part, its total, whether it fits (or why not)."""
    header = ["stage", "flags", *PARTS[:3], "model state", *PARTS[3:], "total", "fits"]
    return grid(header, [_row_cells(str(row.config.stage), row) for row in rows])


def layout_lines(layout: Layout) -> list[str]:
    rows = [
        [
            str(o.tp),
            str(o.pp),
            str(o.dp)
            + (f" (EP {o.row.config.expert_parallel_size})" if o.row.config.expert_parallel_size > 1 else ""),
            str(o.row.config.stage),
            o.row.config.activation_checkpointing,
            format_bytes(o.row.total),
            "n/a" if o.row.unsupported else "yes" if o.row.fits else "NO",
            f"{o.bubble:.0%} (m={o.micro_batches})" if o.pp > 1 else "-",
            f"{o.communication.allreduce_seconds:.2f} s",
        ]
        for o in layout.options
    ]
    header = ["TP", "PP", "DP", "stage", "recompute", "per device", "fits", "bubble", "DP all-reduce"]
    lines = ["", f"layout on paper (TP within a node of {layout.gpus_per_node}, 1F1B pipeline):"]
    lines += grid(header, rows)
    s = layout.suggested
    if s is None:
        lines.append("suggested: none fits; add devices or lower the micro-batch / sequence length.")
    else:
        ep = s.row.config.expert_parallel_size
        lines.append(
            f"suggested: TP={s.tp} x PP={s.pp} x DP={s.dp}{f' (EP {ep})' if ep > 1 else ''}, ZeRO stage {s.row.config.stage},"
            f" recompute {s.row.config.activation_checkpointing}: {format_bytes(s.row.total)} per device,"
            f" bubble {s.bubble:.0%}"
        )
    return lines


def plot_bars(
    bars: list[tuple[str, Breakdown]], device_memory: int, usable_memory: int, title: str, path: str
) -> None:
    """Stacked bars of ``bars`` (label, row) in GB, with the device-memory and usable lines, as a PNG."""
    try:
        # A bare Figure, not pyplot: no global backend switch and no window, in a notebook or a job.
        from matplotlib.figure import Figure  # optional: matplotlib (the plot extra)
    except ImportError as err:
        raise PlanInputError(
            f"--plot {path} needs matplotlib, which is not installed. Run: pip install lightning-shard[plot]"
        ) from err
    fig = Figure(figsize=(1.8 * len(bars) + 2, 4.5))
    ax = fig.subplots()
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        heights = [getattr(row, part) / 1e9 for _, row in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.axhline(device_memory / 1e9, color="black", linestyle="-", linewidth=1, label="device memory")
    ax.axhline(usable_memory / 1e9, color="black", linestyle="--", linewidth=1, label="usable")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GB per device")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")
