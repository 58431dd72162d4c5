"""From the layout to ``ShardStrategy``'s mesh flags: ``tensor_parallel_size``, ``pipeline_parallel_size``
(with ``microbatches``) and ``replicate_size``.

``ShardStrategy`` lays its W ranks out as ``pp x replicate x shard x tp``: tensor-parallel groups
innermost (consecutive ranks, within a node), then the shard groups, then the replicas, then the
pipeline stages. When the plan has a layout (``layout=True``, or the CLI beyond one node):

* TP and PP: the line follows the layout's suggestion. If it has TP = t > 1 or PP = p > 1, the
  recommended row is that option's, computed with t and p (parameters divided by t x p, activations by
  t) and ``tensor_parallel_size=t``, ``pipeline_parallel_size=p``, ``microbatches=m``; with t = p = 1
  the data-parallel search's row stays (it also weighs offloads).
* HSDP: at stages 2-3, when the data-parallel ranks (W / t) span more than one node, shard within a
  node and replicate across nodes: shard groups of S = gpus_per_node / t ranks and
  ``replicate_size = (W / t) / S``. Sharded state then divides by S instead of W / t, so the same
  configuration is weighed again with S as the divisor; if it no longer fits (or the strategy refuses
  it) the line keeps ``replicate_size=1`` and a note says why. So does a line that offloads: its host
  memory (not checked) would grow by the same factor.

Fixed sizes (``plan(tensor_parallel_size=..., replicate_size=...)``, as ``stage="auto"`` passes the
strategy's own) are kept as given: :func:`fixed_setting` is the setting they describe. Context parallelism
(:func:`with_cp`) is taken only when nothing fits without it. Expert parallelism is searched with the other
flags (:mod:`.experts`); it is carved from the shard group, so HSDP keeps it only where it divides a node's.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_shard.parallel.dims import ParallelDims
from lightning_shard.planner.accepted import StrategyCheck
from lightning_shard.planner.layout import Layout, LayoutOption
from lightning_shard.planner.memory import Breakdown, Setting, breakdown, cheapest
from lightning_shard.units import PlanInputError, format_bytes


def check_sizes(
    world_size: int, tensor_parallel_size: int, replicate_size: int, cli: bool = False, pp: int = 1
) -> None:
    """The sizes must divide the world (the strategy's rule), named as ``plan(...)`` or the CLI takes them."""

    def flag(name: str, value: int) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"plan({name}={value})"

    ParallelDims.for_world(
        world_size,
        replicate_size=replicate_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pp,
        flag=flag,
        world="the world size" if cli else "world_size",
        error=PlanInputError,
    )


def fixed_setting(s: Setting, tensor_parallel_size: int, replicate_size: int, pp: int = 1) -> Setting:
    """``s`` (world_size = W) for a mesh of fixed sizes: TP and the pipeline stages divide the model, the
    shard group the state."""
    return replace(
        s,
        world_size=s.world_size // (tensor_parallel_size * replicate_size * pp),
        tp=tensor_parallel_size,
        pp=pp,
    )


def _layout_name(option: LayoutOption) -> str:
    return f"TP={option.tp} x PP={option.pp} x DP={option.dp}"


def with_layout(
    row: Breakdown | None, setting: Setting, layout: Layout
) -> tuple[Breakdown | None, Setting, list[str]]:
    """The recommended row and its setting after the layout: its TP / PP option if it has one (see above)."""
    option = layout.suggested
    if option is None or (option.tp == 1 and option.pp == 1):
        return row, setting, []
    parts = [f"{option.tp}-way tensor parallelism within a node"] if option.tp > 1 else []
    if option.pp > 1:
        parts.append(
            f"{option.pp} pipeline stages of {option.micro_batches} microbatches each step (bubble"
            f" {option.bubble:.0%})"
        )
    note = (
        f"The table is for data parallelism alone (TP=1, PP=1); the recommended line is the layout's"
        f" {_layout_name(option)}, with {' and '.join(parts)}."
    )
    return option.row, replace(setting, world_size=option.dp, tp=option.tp, pp=option.pp), [note]


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
    if shard % row.config.expert_parallel_size:
        return row, [
            f"No HSDP (replicate_size stays 1): expert_parallel_size={row.config.expert_parallel_size} does not"
            f" divide a shard group of one node's {shard} ranks, which expert-parallel groups are carved from."
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


def with_cp(
    rows: list[Breakdown], setting: Setting, check: StrategyCheck
) -> tuple[Breakdown | None, list[str]]:
    """The cheapest of ``rows`` (mesh kept) with the sequence cut over the fewest ranks that make it fit.

    Context parallelism divides each sequence's activations by ``c`` (not the model state), at the cost
    of attention's collectives every layer, so it is taken only when nothing fits without it; ``c`` runs
    over the powers of two dividing the shard group's ranks (the strategy's rule) for which the sequence
    cuts into ``2c`` equal chunks. The method is ``"allgather"``, which runs on any backend and head count.
    """
    seq = setting.seq_len
    if not setting.micro_batch or not seq:
        return None, []
    c = 2
    while setting.world_size % c == 0 and seq % (2 * c) == 0:
        cut = [check.judge(breakdown(setting, replace(row.config, context_parallel_size=c))) for row in rows]
        best = cheapest(cut)
        if best is not None and best.fits:
            note = (
                f"Context parallelism: one sequence's activations do not fit on one device; cut over {c} ranks"
                f" ({seq // c} tokens each, keys and values all-gathered), {best.strategy_line} fits in"
                f" {format_bytes(best.total)}. Pad sequences to a multiple of {2 * c} (docs/context_parallel.md)."
            )
            return best, [note]
        c *= 2
    return None, []
