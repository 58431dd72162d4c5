"""The answer of the planner: a :class:`Plan`, and how it reads as JSON, as a table and as a plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_shard.planner import render
from lightning_shard.planner.layout import Communication, Layout
from lightning_shard.planner.memory import Breakdown
from lightning_shard.planner.model import ModelShape
from lightning_shard.units import format_bytes, format_count

JSON_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """The answer: a row per stage, the recommended configuration, and what it was computed from."""

    model: ModelShape
    world_size: int
    device_memory: int
    margin: float
    precision: str
    optimizer: str
    micro_batch: int | None
    seq_len: int | None
    stages: tuple[Breakdown, ...]
    """Stages 0-3, each with its cheapest fitting flags (else its smallest): searched ``"auto"`` flags, fixed ones kept."""
    recommended: Breakdown | None
    """The cheapest configuration that fits; if none fits, the one with the fewest bytes (``fits`` False)."""
    communication: Communication | None
    layout: Layout | None
    notes: tuple[str, ...] = ()
    engine: str = "auto"
    """``ShardStrategy(engine=...)`` the plan was made for (kept in every recommended line if not ``"auto"``)."""
    nvme_path: str | None = None
    """``ShardStrategy(nvme_path=...)`` for configurations that offload to NVMe."""

    @property
    def usable_memory(self) -> int:
        return int(self.device_memory * (1 - self.margin))

    @property
    def fits(self) -> bool:
        return self.recommended is not None and self.recommended.fits

    @property
    def stage(self) -> int:
        """The recommended stage (what ``ShardStrategy(stage="auto")`` uses)."""
        if self.recommended is None:
            raise RuntimeError("This plan has no runnable configuration; see Plan.notes.")
        return self.recommended.config.stage

    @property
    def strategy(self) -> str | None:
        """The recommended ``ShardStrategy(...)`` line: Python that evaluates to the strategy."""
        return self.recommended.strategy_line if self.recommended else None

    def strategy_kwargs(self) -> dict[str, Any]:
        """The recommended flags as ``ShardStrategy`` keyword arguments (defaults left out)."""
        if self.recommended is None:
            return {}
        return dict(self.recommended.strategy_kwargs or self.recommended.config.strategy_kwargs())

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document; its keys are listed in docs/planner.md and are stable."""
        return {
            "version": JSON_VERSION,
            "model": {
                **{f.name: getattr(self.model, f.name) for f in fields(self.model) if f.name != "tensors"},
                "root_params": self.model.root_params,
                "active_params": self.model.active_params,
                "flops_per_token": self.model.flops_per_token(self.seq_len),
            },
            "inputs": {
                "world_size": self.world_size,
                "device_memory": self.device_memory,
                "usable_memory": self.usable_memory,
                "margin": self.margin,
                "precision": self.precision,
                "optimizer": self.optimizer,
                "micro_batch": self.micro_batch,
                "seq_len": self.seq_len,
                "engine": self.engine,
                "nvme_path": self.nvme_path,
            },
            "stages": [render.row_dict(row) for row in self.stages],
            "recommended": render.row_dict(self.recommended) if self.recommended else None,
            "strategy": self.strategy,
            "fits": self.fits,
            "communication": asdict(self.communication) if self.communication else None,
            "layout": render.layout_dict(self.layout) if self.layout is not None else None,
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The per-device table as plain text (for the console and for logs)."""
        lines = [*self._header(), "", *render.stage_lines(self.stages), ""]
        best = self.recommended
        if best is not None:
            verdict = "fits" if best.fits else "does NOT fit"
            lines.append(
                f"recommended: {best.strategy_line}  ({format_bytes(best.total)} of"
                f" {format_bytes(self.usable_memory)} usable: {verdict})"
            )
        if best is not None and best.config.expert_parallel_size > 1:
            e, m = best.config.expert_parallel_size, self.model
            lines.append(
                f"expert parallel: {m.experts // e} of {m.experts} experts per device ({format_bytes(best.expert_parameters)}"
                f" of expert parameters); all-to-all buffers {format_bytes(best.buffers_detail.get('all_to_all', 0))}"
            )
        if self.communication is not None:
            c = self.communication
            lines.append(
                f"data parallel: gradient all-reduce of {format_bytes(c.gradient_bytes)} takes"
                f" {c.allreduce_seconds:.3g} s at {format_bytes(c.bandwidth)}/s; stage {self.stage} moves"
                f" {format_bytes(c.step_bytes)} per step ({c.step_seconds:.3g} s)"
            )
        if self.layout is not None:
            lines += render.layout_lines(self.layout)
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _header(self) -> list[str]:
        m = self.model
        shape = f"{m.layers} layers x {m.hidden} hidden, {m.heads} heads, vocab {m.vocab}"
        batch = (
            f"micro-batch {self.micro_batch} x seq {self.seq_len}" if self.micro_batch else "no micro-batch"
        )
        if m.experts:
            shape += (
                f"; {m.experts} experts, top-{m.top_k}: {format_count(m.expert_params)} in experts,"
                f" {format_count(m.active_params)} active per token"
            )
        return [
            f"model: {m.source}, {format_count(m.params)} parameters ({shape}{', inferred' if m.inferred else ''})",
            f"per device: {format_bytes(self.device_memory)}, usable {format_bytes(self.usable_memory)}"
            f" (margin {self.margin:.0%}); {self.world_size} devices; {self.precision}, {self.optimizer}; {batch}",
        ]

    def plot(self, path: str) -> None:
        """Stacked bars of the table, one per stage plus the recommendation (needs matplotlib)."""
        bars = [(f"stage {row.config.stage}\n{render.flags(row.config)}", row) for row in self.stages]
        if self.recommended is not None:
            bars.append((f"recommended\n{render.flags(self.recommended.config)}", self.recommended))
        title = f"{self.model.source}: {format_count(self.model.params)} params, {self.world_size} devices"
        render.plot_bars(bars, self.device_memory, self.usable_memory, title, path)
