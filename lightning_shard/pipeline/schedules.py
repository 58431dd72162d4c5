"""Pipeline schedules by name, and the checks on the pipeline flags that need no process.

``ShardStrategy(pipeline_schedule=...)`` names one of torch's own schedules
(:mod:`torch.distributed.pipelining.schedules`). With ``p`` stages and ``m`` microbatches, GPipe and 1F1B
leave every rank idle for a fraction ``(p - 1) / (m + p - 1)`` of a step (the bubble: the first stage waits
for ``p - 1`` microbatch times at the end, the last at the start); 1F1B holds at most ``p`` microbatches'
activations where GPipe holds all ``m``. The interleaved schedules put ``v`` stages on each rank (rank
``r`` runs stages ``r, r + p, ..., r + (v - 1) p``: the model is cut into ``p x v`` stages) and cut the
bubble to ``(p - 1) / (v m + p - 1)``; zero bubble also splits each backward into the input gradient, which
the previous stage waits for, and the weight gradient, which fills the idle time.
"""

from __future__ import annotations

from typing import Any, Literal

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

PipelineScheduleName = Literal["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"]
SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
#: Schedules that compute a stage's input gradients and its weight gradients in separate steps.
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble",)
#: Stages per rank of the interleaved schedules when ``stages_per_rank`` is not given.
INTERLEAVED_STAGES_PER_RANK = 2
#: Microbatches per stage when ``microbatches`` is not given: ``m = 2p`` keeps the GPipe / 1F1B bubble
#: ``(p - 1) / (m + p - 1)`` under a third while each microbatch stays large enough to keep a device busy.
MICROBATCHES_PER_STAGE = 2


def schedule_class(name: str) -> type[Any]:
    """The torch schedule class for ``name``."""
    classes: dict[str, type[Any]] = {
        "1f1b": Schedule1F1B,
        "gpipe": ScheduleGPipe,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleInterleavedZeroBubble,
    }
    return classes[name]


def stages_of_rank(rank: int, size: int, stages_per_rank: int) -> tuple[int, ...]:
    """The stages rank ``rank`` of ``size`` runs: ``rank, rank + size, ...`` (the interleaved schedules'
    looped placement; one stage per rank otherwise)."""
    return tuple(rank + k * size for k in range(stages_per_rank))


def check_pipeline_flags(
    size: Any,
    schedule: Any,
    microbatches: Any,
    stages_per_rank: Any,
    split_points: Any,
    checkpoint: str = "sharded",
) -> tuple[int, int, tuple[str, ...] | None]:
    """Check the pipeline flags against each other; returns ``(microbatches, stages_per_rank, split_points)``
    with the defaults filled in. Whether ``pipeline_parallel_size`` divides the world is checked once the
    Trainer knows it."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"ShardStrategy(pipeline_parallel_size={size!r}) must be an integer >= 1 (1: off): the number of"
            " pipeline stages the model is cut into."
        )
    stages_per_rank = _check_schedule(schedule, stages_per_rank, size)
    microbatches = _check_microbatches(size, microbatches, split_points)
    _check_rounds(schedule, size, microbatches)
    _check_combinations(size, checkpoint)
    return microbatches, stages_per_rank, _check_split_points(split_points, size * stages_per_rank)


def _check_schedule(schedule: Any, stages_per_rank: Any, size: int) -> int:
    if schedule not in SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise ValueError(
            f"ShardStrategy(pipeline_schedule={schedule!r}) is unknown. Use '1f1b' (the default), 'gpipe',"
            " 'interleaved_1f1b' or 'zero_bubble'."
        )
    if stages_per_rank is None:
        stages_per_rank = INTERLEAVED_STAGES_PER_RANK if schedule in MULTI_STAGE_SCHEDULES and size > 1 else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(
            f"ShardStrategy(stages_per_rank={stages_per_rank!r}) must be an integer >= 1: the pipeline stages"
            " each rank runs (2 or more with pipeline_schedule='interleaved_1f1b' or 'zero_bubble')."
        )
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ValueError(
            f"ShardStrategy(pipeline_schedule={schedule!r}, stages_per_rank={stages_per_rank}): this schedule runs"
            " one stage per rank. Use pipeline_schedule='interleaved_1f1b' or 'zero_bubble' for several, or"
            " drop stages_per_rank."
        )
    if schedule in MULTI_STAGE_SCHEDULES and size > 1 and stages_per_rank < 2:
        raise ValueError(
            f"ShardStrategy(pipeline_schedule={schedule!r}, stages_per_rank={stages_per_rank}) interleaves"
            " several stages on each rank. Use stages_per_rank >= 2 (default 2), or pipeline_schedule='1f1b'."
        )
    return stages_per_rank


def _check_rounds(schedule: Any, size: int, microbatches: int) -> None:
    """torch's interleaved schedules run the microbatches in rounds of ``size``: they must fill whole rounds."""
    rounds = max(1, microbatches // size)
    if size > 1 and schedule in MULTI_STAGE_SCHEDULES and microbatches % rounds:
        raise ValueError(
            f"ShardStrategy(pipeline_schedule={schedule!r}, microbatches={microbatches},"
            f" pipeline_parallel_size={size}): the interleaved schedules run microbatches in rounds of"
            f" {size}, so microbatches must be a multiple of {rounds} (microbatches // {size}). Use e.g."
            f" microbatches={rounds * size}."
        )


def _check_microbatches(size: int, microbatches: Any, split_points: Any) -> int:
    if size == 1 and (microbatches is not None or split_points is not None):
        flag = f"microbatches={microbatches}" if split_points is None else "pipeline_split_points=..."
        raise ValueError(
            f"ShardStrategy({flag}) is only used with pipeline_parallel_size > 1 (got 1). Set"
            " pipeline_parallel_size, or drop the flag."
        )
    if microbatches is None:
        microbatches = MICROBATCHES_PER_STAGE * size if size > 1 else 1
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"ShardStrategy(microbatches={microbatches!r}) must be an integer >= 1: the number of pieces each"
            " batch is cut into along its first dimension (default 2 x pipeline_parallel_size)."
        )
    if size > 1 and microbatches < size:
        raise ValueError(
            f"ShardStrategy(microbatches={microbatches}, pipeline_parallel_size={size}): fewer microbatches than"
            f" stages leaves stages idle for the whole step. Use microbatches >= {size} (e.g. {2 * size})."
        )
    return microbatches


def _check_combinations(size: int, checkpoint: str) -> None:
    """The pipeline flag against the checkpoint mode (against the engine: its ``Capabilities.dims``)."""
    if size > 1 and checkpoint == "full":
        raise ValueError(
            f"ShardStrategy(checkpoint='full', pipeline_parallel_size={size}) cannot run: one file is gathered on"
            " rank 0, which holds only the first stage. Use checkpoint='sharded' (every stage writes its own"
            " part; `lightning-shard consolidate` makes one file)."
        )


def _check_split_points(points: Any, size: int) -> tuple[str, ...] | None:
    if points is None:
        return None
    if isinstance(points, str) or not all(isinstance(p, str) for p in points):
        raise ValueError(
            f"ShardStrategy(pipeline_split_points={points!r}) must be a list of module names, each the block"
            " that starts a stage, e.g. ['model.blocks.2']."
        )
    points = tuple(points)
    if len(points) != size - 1:
        raise ValueError(
            f"ShardStrategy(pipeline_split_points={list(points)!r}) names {len(points)} split points;"
            f" {size} stages need {size - 1} (the first block of every stage but the first; with"
            " stages_per_rank, pipeline_parallel_size x stages_per_rank stages)."
        )
    return points


__all__ = [
    "INTERLEAVED_STAGES_PER_RANK",
    "MICROBATCHES_PER_STAGE",
    "PipelineScheduleName",
    "check_pipeline_flags",
    "schedule_class",
    "stages_of_rank",
]
