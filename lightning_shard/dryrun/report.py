"""What one rank of a dry run holds: :class:`RankReport`, as JSON and as a table beside the planner's figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_shard.units import format_bytes

JSON_VERSION = 1
#: The planner's figures of one step (with a traced step), beside its model state's in ``RankReport.planner``.
STEP_KINDS = ("activations", "buffers")


def _model_state(planner: dict[str, int]) -> int:
    return sum(v for k, v in planner.items() if k not in STEP_KINDS)


@dataclass(frozen=True)
class RankReport:
    """One rank's place in the layout and the bytes its real shards take (padding included)."""

    rank: int
    world_size: int
    coordinates: dict[str, int]
    """``ParallelDims.coordinates``: ``pp replicate shard cp tp``, and ``edp ep`` inside ``shard x cp``."""
    pipeline_stages: tuple[int, ...]
    """The pipeline stages this rank runs (``()`` without pipeline parallelism)."""
    layers: tuple[int, ...]
    """The indices of the repeated blocks (transformer layers) this rank holds."""
    experts: tuple[int, ...]
    """The experts this rank holds of each experts module (``()`` for a dense model)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    params: int
    """Elements of this rank's parameter shards, padding included."""
    checkpoint_files: tuple[str, ...]
    checkpoint_bytes: int
    """Bytes this rank writes in a sharded checkpoint (chunks held by several ranks shared among them)."""
    build_seconds: float
    """The set-up of this rank on the fake group: model on meta, ``prepare``, optimizers, checkpoint plan."""
    collective_bytes: dict[str, int] = field(default_factory=dict)
    """The data-parallel collectives of one step by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``),
    from the shards (:func:`~lightning_shard.dryrun.measure.collective_bytes`)."""
    planner: dict[str, int] | None = None
    """The planner's ``parameters``, ``gradients`` and ``optimizer`` for the same flags at this rank's place (its
    pipeline stage and index in the shard group), and the ``host`` bytes its offloads keep off the device (the dry
    run counts every shard, wherever it lives); with a traced step, its ``activations`` and ``buffers`` too."""
    peak_bytes: int | None = None
    """A traced step's peak memory (``dryrun(trace_step=True)``; ``None`` where the step is not traced)."""
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    """The live bytes of each of torch's memory tracker's categories at that peak."""
    traced_state_bytes: dict[str, int] = field(default_factory=dict)
    """The ``parameters``, ``gradients`` and ``optimizer`` state the tracker sees live after the traced backward."""
    traced_collective_bytes: dict[str, int] = field(default_factory=dict)
    """The collectives the fake group received in the traced step, by kind (each call's largest buffer)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def difference(self, kind: str) -> float | None:
        """The planner's figure against the dry run's, in % of the dry run's (``None`` without one, or for a kind
        the planner counts on the host: the model state then compares device and host together)."""
        mine = {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes,
            "optimizer": self.optimizer_bytes,
        }
        if self.planner is None or (kind != "model_state" and self.planner.get("host")):
            return None
        if kind == "model_state":
            theirs, ours = _model_state(self.planner), self.model_state_bytes
        else:
            theirs, ours = self.planner[kind], mine[kind]
        return 0.0 if ours == theirs else (100.0 * (theirs - ours) / ours if ours else float("inf"))

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` record of this rank (keys in docs/dryrun.md)."""
        out = asdict(self)
        out["model_state_bytes"] = self.model_state_bytes
        if self.planner is not None:
            out["planner_difference_pct"] = {
                kind: self.difference(kind)
                for kind in ("parameters", "gradients", "optimizer", "model_state")
            }
        return out


def _span(values: tuple[int, ...]) -> str:
    if not values:
        return "-"
    if list(values) == list(range(values[0], values[-1] + 1)):
        return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _beside(report: RankReport, kind: str, ours: int) -> str:
    diff = report.difference(kind)
    if diff is None or report.planner is None:
        return format_bytes(ours)
    theirs = _model_state(report.planner) if kind == "model_state" else report.planner[kind]
    return f"{format_bytes(ours)} ({format_bytes(theirs)} {diff:+.1f}%)"


def _peak(report: RankReport) -> str:
    """The traced step's peak, beside the planner's model state, activations and buffers."""
    if report.peak_bytes is None:
        return "-"
    planner = report.planner or {}
    if not all(k in planner for k in STEP_KINDS):
        return format_bytes(report.peak_bytes)
    theirs = _model_state(planner) + sum(planner[k] for k in STEP_KINDS)
    return f"{format_bytes(report.peak_bytes)} ({format_bytes(theirs)})"


def table(reports: list[RankReport]) -> str:
    """One line per rank; each figure with the planner's beside it (and the difference in % of the dry run's)."""
    head: tuple[str, ...] = ("rank", "place", "stage", "layers", "experts", "parameters", "gradients")
    head += ("optimizer", "model state", "checkpoint", "build")
    traced = any(r.peak_bytes is not None for r in reports)
    if traced:
        head += ("step peak",)
    rows: list[tuple[str, ...]] = [head]
    for r in reports:
        place = " ".join(f"{k}{v}" for k, v in r.coordinates.items() if k not in ("edp", "ep") or r.experts)
        rows.append(
            (
                str(r.rank),
                place,
                _span(r.pipeline_stages),
                _span(r.layers),
                _span(r.experts),
                _beside(r, "parameters", r.param_bytes),
                _beside(r, "gradients", r.grad_bytes),
                _beside(r, "optimizer", r.optimizer_bytes),
                _beside(r, "model_state", r.model_state_bytes),
                f"{format_bytes(r.checkpoint_bytes)} in {len(r.checkpoint_files)} file(s)",
                f"{r.build_seconds:.2f} s",
            )
            + ((_peak(r),) if traced else ())
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    notes = sorted({note for r in reports for note in r.notes})
    planner = " (planner's figure and its difference in brackets)" if any(r.planner for r in reports) else ""
    world = reports[0].world_size if reports else 0
    return "\n".join(
        [f"dry run of {len(reports)} of {world} ranks{planner}", "", *lines, *(f"note: {n}" for n in notes)]
    )
