"""From the layout to ``ShardStrategy``'s mesh flags: ``tensor_parallel_size`` and ``replicate_size``.

``ShardStrategy`` lays its W ranks out as ``replicate x shard x tp``: tensor-parallel groups innermost
(consecutive ranks, within a node), then the shard groups, then the replicas. Pipeline parallelism is
not one of its flags. When the plan has a layout (``layout=True``, or the CLI beyond one node):

* TP: the line follows the layout's best option without pipeline parallelism (``Layout.runnable``).
  If it has TP = t > 1, the recommended row is that option's, computed with t (parameters divided by
  t, activations by t) and ``tensor_parallel_size=t``; with t = 1 the data-parallel search's row stays
  (it also weighs offloads). A suggested layout with PP > 1 gets a note: it needs a pipeline runtime.
* HSDP: at stages 2-3, when the data-parallel ranks (W / t) span more than one node, shard within a
  node and replicate across nodes: shard groups of S = gpus_per_node / t ranks and
  ``replicate_size = (W / t) / S``. Sharded state then divides by S instead of W / t, so the same
  configuration is weighed again with S as the divisor; if it no longer fits (or the strategy refuses
  it) the line keeps ``replicate_size=1`` and a note says why. So does a line that offloads: its host
  memory (not checked) would grow by the same factor.

Fixed sizes (``plan(tensor_parallel_size=..., replicate_size=...)``, as ``stage="auto"`` passes the
strategy's own) are kept as given: :func:`fixed_setting` is the setting they describe.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_shard.planner.accepted import StrategyCheck
from lightning_shard.planner.layout import Layout, LayoutOption
from lightning_shard.planner.memory import Breakdown, Setting, breakdown
from lightning_shard.units import PlanInputError, format_bytes


def check_sizes(world_size: int, tensor_parallel_size: int, replicate_size: int, cli: bool = False) -> None:
    """Both sizes must divide the world (the strategy's rule), named as ``plan(...)`` or the CLI takes them."""
    from lightning_shard.parallel.mesh import check_world

    def flag(name: str, value: int) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"plan({name}={value})"

    world = "the world size" if cli else "world_size"
    check_world(world_size, replicate_size, tensor_parallel_size, flag, world, PlanInputError)


def fixed_setting(s: Setting, tensor_parallel_size: int, replicate_size: int) -> Setting:
    """``s`` (world_size = W) for a mesh of fixed sizes: TP divides the model, the shard group the state."""
    return replace(
        s, world_size=s.world_size // (tensor_parallel_size * replicate_size), tp=tensor_parallel_size
    )


def _layout_name(option: LayoutOption) -> str:
    return f"TP={option.tp} x PP={option.pp} x DP={option.dp}"


def with_layout(
    row: Breakdown | None, setting: Setting, layout: Layout
) -> tuple[Breakdown | None, Setting, list[str]]:
    """The recommended row and its setting after the layout: its TP option if it has one (see above)."""
    notes = []
    suggested, runnable = layout.suggested, layout.runnable
    if suggested is not None and suggested.pp > 1:
        needs = (
            f"The suggested layout {_layout_name(suggested)} needs a pipeline-parallel runtime, which"
            " ShardStrategy does not provide"
        )
        if runnable is None:
            notes.append(
                f"{needs}, and no layout without pipeline parallelism fits: the recommended line is the"
                " data-parallel search's."
            )
        else:
            notes.append(f"{needs}; the recommended line is for {_layout_name(runnable)}.")
    if runnable is None or runnable.tp == 1:
        return row, setting, notes
    notes.append(
        f"The table is for data parallelism alone (TP=1); the recommended line is the layout's"
        f" {_layout_name(runnable)}, with {runnable.tp}-way tensor parallelism within a node."
    )
    return runnable.row, replace(setting, world_size=runnable.dp, tp=runnable.tp, pp=1), notes


def with_hsdp(
    row: Breakdown, setting: Setting, gpus_per_node: int, check: StrategyCheck
) -> tuple[Breakdown, list[str]]:
    """``row`` as HSDP (shard within a node, replicate across nodes) if that still fits; else why not.

    ``setting`` is the one ``row`` was computed in (its data-parallel ranks and TP degree).
    """
    dp, tp = setting.world_size, setting.tp
    shard = gpus_per_node // tp
    if row.config.stage < 2 or dp * tp <= gpus_per_node or shard < 2 or not row.fits:
        # Stages 0-1 replicate anyway; within one node the shard group is every rank; a node that TP
        # fills has no ranks left to shard over; and what does not fit over every rank fits less over fewer.
        return row, []
    if row.host:
        return row, [
            f"No HSDP (replicate_size stays 1): {row.strategy_line} offloads to host memory, which shard"
            f" groups of {shard} instead of {dp} ranks would multiply by {dp // shard} (host memory is not checked)."
        ]
    if dp % shard:
        return row, [
            f"No HSDP (replicate_size stays 1): a shard group of one node's {shard} ranks"
            f" (gpus_per_node={gpus_per_node} / TP={tp}) does not divide the {dp} data-parallel ranks."
        ]
    replicate = dp // shard
    hybrid = check.judge(
        breakdown(replace(setting, world_size=shard), replace(row.config, replicate_size=replicate))
    )
    if hybrid.fits:
        within = f"one node's {gpus_per_node} ranks / TP={tp}" if tp > 1 else "one node"
        return hybrid, [
            f"HSDP: shard groups of {shard} ranks ({within}), {replicate} replicas across nodes: parameters"
            f" are gathered within a node and only gradients cross nodes. Sharded state divides by {shard},"
            f" not {dp}: {format_bytes(hybrid.total)} per device instead of {format_bytes(row.total)}."
        ]
    why = (hybrid.unsupported or "").rstrip(".") or (
        f"sharded over {shard} ranks instead of {dp}, {hybrid.strategy_line} needs"
        f" {format_bytes(hybrid.total)} per device, over the {format_bytes(hybrid.usable)} usable"
    )
    return (
        row,
        [
            f"No HSDP (replicate_size stays 1, sharding over all {dp} data-parallel ranks, across nodes):"
            f" {why}."
        ],
    )
